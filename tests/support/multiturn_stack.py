"""The live rows of benchmarks/multiturn.py: real vLLM CPU engines behind ``kvplane router``.

Every row runs the same thing except its KV tiers: ``instances`` vLLM OpenAI servers (the same
random-weight Llama, prefix caching on, KV events to the router) behind one ``kvplane router``
(cache-aware ``mooncake`` policy, its own token), and the benchmark's conversations go to the
router. The rows:

* ``L1``: vLLM's own prefix cache only, ``l1_tokens`` of KV per instance.
* ``L2``: plus a private host-DRAM tier of ``l2_mib`` per instance: each instance has its own
  kvplane master and segment (same host, shared memory) through ``KVPlaneStoreConnector``. vLLM
  CPU 0.32 runs neither of the usual L2s: its native CPU offloading stops at start with "CPU
  Offloading is currently only supported on CUDA-alike and XPU GPUs" (``VLLM_USE_SIMPLE_KV_OFFLOAD``:
  CUDA streams), and LMCache is not in the vLLM venv (in the engines venv, vLLM CPU starts
  LMCache in degraded mode: no CPU connector, docs/engines.md).
* ``kvplane``: one kvplane pool of ``l3_mib`` (a ``kvplane segment`` process) shared by every
  instance through ``KVPlaneStoreConnector`` (protocol ``auto``: shared memory on one host).
* ``kvplane-offload``: the same pool through vLLM's own ``OffloadingConnector`` with kvplane's
  ``KVPlaneOffloadingSpec`` as its medium (:mod:`kvplane.integrations.vllm.offload`).
* ``mooncake``: the same with real Mooncake: vLLM's own ``MooncakeStoreConnector``
  (``standalone-store`` mode) on ``mooncake_master`` + a ``mooncake_client`` store server holding
  ``l3_mib`` (Mooncake's TCP transport: no RDMA here).
* ``kvplane-ssd``: the kvplane pool with ``ssd_dram_mib`` of DRAM, below the working set, and an
  SSD tier of ``ssd_disk_mib`` (``kvplane segment --disk-dir``).

Test kit, not product: only benchmarks/multiturn.py uses it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any

import httpx

from kvplane.bench import multiturn_report as report
from kvplane.bench.multiturn import MultiturnConfig, RequestRecord
from kvplane.bench.services import spawn_master, spawn_segment
from kvplane.common.procs import Proc, wait_until
from tests.support.vllm_harness import (
    BS,
    VLLM_PYTHON,
    OpenAIServer,
    make_model,
    offload_kv_config,
    store_kv_config,
)

# a scaled-down Llama (random weights, fp32): 4 layers, hidden 512, 8 heads of 64, MHA
MODEL = {"hidden": 512, "layers": 4, "heads": 8, "intermediate": 1536, "max_pos": 4096}
ROWS = ("L1", "L2", "kvplane", "kvplane-offload", "mooncake", "kvplane-ssd")
LABELS = {"L1": "L1 (vLLM prefix cache)", "L2": "+L2 (host DRAM, per instance)",
          "kvplane": "+kvplane L3", "kvplane-offload": "+kvplane L3 (OffloadingConnector)",
          "mooncake": "+Mooncake L3", "kvplane-ssd": "+kvplane L3, DRAM < WS, +SSD"}
ENGINES_VENV = os.environ.get("KVPLANE_ENGINES_VENV", "/opt/kvplane-engines-venv")


# the benchmark's model on this CPU, for the router's time model: its KV layout (16 KiB a token),
# its weights, a prefill fit from the recorded runs (about 0.45 ms a token: 2064 tokens in
# 922 ms) and the rate a pool load reached in them (2048 tokens, 32 MiB, served in 60 ms)
ROUTER_SET = (f"model.layers={MODEL['layers']}", f"model.hidden={MODEL['hidden']}",
              "model.gqa=1", "model.dtype_bytes=4", "model.params=15e6",
              "model.hbm_bytes_per_s=1e10", "model.prefill_fit=0.02,4.5e-4,0",
              "cluster.h2d_bytes_per_s=5e8", "cluster.pool_bytes_per_s=5e8")


@dataclass(frozen=True)
class Sizes:
    """Capacities of the live rows (``--stack-json`` overrides any field).

    Attributes:
        instances: vLLM servers behind the router.
        max_num_seqs: sequences one server batches.
        l1_tokens: vLLM KV cache per instance, tokens.
        l2_mib: the L2 row's private DRAM tier per instance, MiB.
        l3_mib: the shared pool of the L3 rows, MiB.
        ssd_dram_mib: DRAM of the SSD row's pool, MiB.
        ssd_disk_mib: SSD quota of the SSD row's pool, MiB.
        policy: the router's policy.
        router_set: ``kvplane router --set`` items that describe these engines to the policy's
            time model (default: the benchmark's model on this CPU; the router's own default
            is a 70B model on H100s, whose estimates are 10-20x off here).
        pool_events: the kvplane rows' master publishes its KV events and the router indexes
            them (``kvplane router --pool``): a prefix in the shared pool counts for every
            instance. (Real Mooncake 0.3.13's store publishes none.)
        mooncake_dir: directory holding real Mooncake's ``mooncake`` package ("" = the engines
            venv's ``mooncake-real``, else ``/tmp/mc-venv``).
    """

    instances: int = 2
    max_num_seqs: int = 2
    l1_tokens: int = 3072
    l2_mib: int = 96
    l3_mib: int = 1024
    ssd_dram_mib: int = 96
    ssd_disk_mib: int = 2048
    policy: str = "mooncake"
    pool_events: bool = True
    router_set: tuple[str, ...] = ROUTER_SET
    mooncake_dir: str = ""


def kv_bytes_per_token(spec: dict[str, int] = MODEL) -> int:
    """K and V of every layer, fp32, all heads (the model is MHA)."""
    return spec["layers"] * 2 * spec["hidden"] * 4


def mooncake_path(sizes: Sizes, work: pathlib.Path) -> pathlib.Path | None:
    """A directory with only real Mooncake's package (and its libs), for PYTHONPATH; None if absent."""
    for site in (sizes.mooncake_dir, f"{ENGINES_VENV}/mooncake-real",
                 "/tmp/mc-venv/lib/python3.11/site-packages"):
        if site and (pathlib.Path(site) / "mooncake" / "mooncake_master").exists():
            link = work / "mooncake-path"
            link.mkdir(exist_ok=True)
            for name in ("mooncake", "mooncake_transfer_engine_non_cuda.libs"):
                if (pathlib.Path(site) / name).exists() and not (link / name).exists():
                    (link / name).symlink_to(pathlib.Path(site) / name)
            return link
    return None


# rows: each returns one kv_transfer_config (or None) and env per instance -------------------------
Setup = list[tuple[dict[str, Any] | None, dict[str, str], str]]
Drive = Callable[[dict[str, tuple[str, dict[str, str]]], MultiturnConfig],
                 dict[str, list[RequestRecord]]]
Emit = Callable[[dict[str, list[RequestRecord]], dict[str, Any], "dict[str, dict[int, float]] | None"],
                None]


def _pool(stack: ExitStack, size_mib: int, *seg_args: str, pools: list[str] | None = None) -> str:
    """A master and one segment of ``size_mib``; with ``pools``, the master publishes its KV
    events and their ``--pool`` spec (endpoint, replay, the master's token) is appended."""
    master = stack.enter_context(spawn_master(*(["--kv-events-port", "0"] if pools is not None
                                                else [])))
    stack.enter_context(spawn_segment(master.info["master"], f"{size_mib}MiB", *seg_args))
    if pools is not None:
        from kvplane.common.auth import server_token

        token = server_token("", False).token  # what the master resolved (env or token file)
        pools.append(f"{master.info['kv_events']},replay={master.info['kv_events_replay']}"
                     + (f",token={token}" if token else ""))
    return str(master.info["master"])


def setup_row(row: str, sizes: Sizes, stack: ExitStack, work: pathlib.Path,
              pools: list[str] | None = None) -> Setup:
    """Start the row's KV services; per instance: (kv_transfer_config, env, extra PYTHONPATH).
    A shared kvplane pool appends its ``kvplane router --pool`` spec to ``pools`` (if given and
    ``sizes.pool_events``)."""
    n = sizes.instances
    events = pools if sizes.pool_events else None
    if row == "L1":
        return [(None, {}, "")] * n
    if row == "L2":
        return [(store_kv_config(_pool(stack, sizes.l2_mib), protocol="auto"), {}, "")
                for _ in range(n)]
    if row == "kvplane":
        return [(store_kv_config(_pool(stack, sizes.l3_mib, pools=events), protocol="auto"),
                 {}, "")] * n
    if row == "kvplane-offload":
        return [(offload_kv_config(_pool(stack, sizes.l3_mib, pools=events), protocol="auto"),
                 {}, "")] * n
    if row == "kvplane-ssd":
        disk = work / "ssd"
        disk.mkdir(exist_ok=True)
        master = _pool(stack, sizes.ssd_dram_mib, "--disk-dir", str(disk),
                       "--disk-size", f"{sizes.ssd_disk_mib}MiB", pools=events)
        return [(store_kv_config(master, protocol="auto"), {}, "")] * n
    if row == "mooncake":
        return _mooncake(sizes, stack, work)
    raise ValueError(f"unknown row {row!r}; rows: {', '.join(ROWS)}")


def _mooncake(sizes: Sizes, stack: ExitStack, work: pathlib.Path) -> Setup:
    from tests.support.mooncake_real import RealMooncake

    path = mooncake_path(sizes, work)
    if path is None:
        raise FileNotFoundError("real Mooncake not found: KVPLANE_ENGINES_REAL_MOONCAKE=1 bash "
                                ".ci/setup-30-engines-venv.sh (or set mooncake_dir)")
    mc = stack.enter_context(RealMooncake(path / "mooncake", work, f"{sizes.l3_mib} MB"))
    cfg = work / "mooncake.json"
    cfg.write_text(json.dumps({"mode": "standalone-store", "metadata_server": mc.metadata,
                               "master_server_address": mc.master, "protocol": "tcp",
                               "device_name": "", "global_segment_size": 0,
                               "local_buffer_size": "256MB"}))
    kv = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
          "kv_load_failure_policy": "recompute"}
    env = {"MOONCAKE_CONFIG_PATH": str(cfg), "MC_TCP_BIND_ADDRESS": "127.0.0.1",
           "GLOG_minloglevel": "1"}
    return [(kv, env, str(path))] * sizes.instances


# one row's engines and router ---------------------------------------------------------------------
ROUTER_TOKEN = secrets.token_urlsafe(24)


@dataclass
class RowHandle:
    """A started row: the router's URL and auth header, and the vLLM servers behind it."""

    url: str
    headers: dict[str, str]
    servers: list[OpenAIServer]


@contextmanager
def row_stack(row: str, sizes: Sizes, model: str, max_len: int,
              work: pathlib.Path) -> Iterator[RowHandle]:
    """Start the row (services, engines, router), warm the engines up; yield the handle."""
    with ExitStack() as stack:
        pools: list[str] = []
        setup = setup_row(row, sizes, stack, work, pools)
        servers = []
        for i, (kv, env, path) in enumerate(setup):
            extra = ["--enable-prompt-tokens-details", "--max-num-batched-tokens", str(max_len),
                     "--kv-cache-memory-bytes", str(sizes.l1_tokens * kv_bytes_per_token())]
            if kv is not None:
                extra += ["--kv-transfer-config", json.dumps(kv), "--disable-hybrid-kv-cache-manager"]
            srv = OpenAIServer(model, work / f"vllm{i}.log", events=f"ipc://{work}/kv{i}",
                               replay=f"ipc://{work}/replay{i}", max_model_len=max_len,
                               max_num_seqs=sizes.max_num_seqs, extra=extra,
                               env={"VLLM_CPU_KVCACHE_SPACE": None, **env}, extra_path=path)
            stack.callback(srv.close)
            servers.append(srv)
        for s in servers:
            wait_until(s.ready, 900, f"vLLM server {s.url} ({row})")
        for s in servers:
            warm_up(s, max_len)
        argv = [sys.executable, "-m", "kvplane.cli.router", "--policy", sizes.policy, "--port", "0",
                "--token", ROUTER_TOKEN, "--block-size", str(BS)]
        for i, s in enumerate(servers):
            argv += ["--backend", f"{s.url},events=ipc://{work}/kv{i},replay=ipc://{work}/replay{i}"]
        for p in pools:
            argv += ["--pool", p]
        for item in sizes.router_set:
            argv += ["--set", item]
        router = stack.enter_context(Proc(argv, ready_timeout=60, stop_signal=15))
        url = str(router.info["router"])
        wait_until(lambda: _all_up(url, len(servers)), 120, "router backends up")
        yield RowHandle(url, {"Authorization": f"Bearer {ROUTER_TOKEN}"}, servers)


def _complete(url: str, tokens: list[int], max_tokens: int) -> tuple[float, int]:
    """Seconds for one non-streamed completion, and its cached prompt tokens."""
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": tokens,
                                                  "max_tokens": max_tokens, "ignore_eos": True},
                   timeout=600, trust_env=False)
    r.raise_for_status()
    details = r.json()["usage"].get("prompt_tokens_details") or {}
    return time.perf_counter() - t0, int(details.get("cached_tokens") or 0)


def _tokens(seed: int, n: int) -> list[int]:
    return [(i * 7919 + seed * 104729) % 990 + 5 for i in range(n)]


def warm_up(server: OpenAIServer, max_len: int) -> None:
    """First-call costs out of the way: a prompt, the same prompt grown (the prefix-hit path),
    the prompt again after a prefix-cache reset (the row's load path, if it has a tier); then an
    empty prefix cache. Prompts fit ``max_len``."""
    n = min(512, max_len // 2)
    base = _tokens(n, n)
    _complete(server.url, base, 2)
    _complete(server.url, base + _tokens(64, n // 4), 2)
    server.reset_prefix_cache()
    _complete(server.url, base, 2)
    server.reset_prefix_cache()


def load_vs_recompute(server: OpenAIServer, n: int, reps: int = 3) -> dict[str, Any]:
    """TTFT of a fresh ``n``-token prompt (recompute) and of the same prompt after a local
    prefix-cache reset (load from the row's external tier, then the last block computed);
    medians of ``reps`` prompts. A hit that did not cover the loadable blocks is retried twice
    (its save may still be landing)."""
    loadable = (n - 1) // BS * BS
    miss, hit, cached = [], [], []
    for rep in range(reps):
        toks = _tokens(10_000 + rep, n)
        miss.append(_complete(server.url, toks, 1)[0])
        for _ in range(3):
            server.reset_prefix_cache()
            took, got = _complete(server.url, toks, 1)
            if got >= loadable:
                break
        hit.append(took)
        cached.append(got)
    med_miss, med_hit = statistics.median(miss), statistics.median(hit)
    return {"prompt_tokens": n, "recompute_s": med_miss, "hit_s": med_hit, "hit_tokens": min(cached),
            "recompute_ms_per_token": 1000 * med_miss / n, "hit_over_recompute": med_hit / med_miss,
            "recompute_all_s": miss, "hit_all_s": hit}


def _all_up(url: str, n: int) -> bool:
    h = httpx.get(url + "/health", timeout=5, trust_env=False).json()
    return bool(h.get("backends_up") == n)


# the benchmark ------------------------------------------------------------------------------------
def max_model_len(cfg: MultiturnConfig) -> int:
    need = cfg.prompt_tokens(cfg.rounds) + cfg.output_length + BS
    return -(-need // 256) * 256


def row_list(spec: str) -> list[str]:
    """``"L1,kvplane"`` -> ``["L1", "kvplane"]`` (unknown rows raise)."""
    out = [r.strip() for r in spec.split(",") if r.strip()]
    bad = [r for r in out if r not in ROWS]
    if bad:
        raise ValueError(f"unknown rows {bad}; rows: {', '.join(ROWS)}")
    return out


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds every row's ExitStack: engines stop


def run_rows(rows: list[str], cfg: MultiturnConfig, sizes: Sizes, model: str, work: pathlib.Path,
             drive: Drive, probes: dict[str, Any] | None = None) -> dict[str, list[RequestRecord]]:
    """Each row in turn on the same workload: start its engines, run, stop them (so at most
    ``sizes.instances`` vLLM servers are ever alive). A row that fails is reported and skipped.

    With ``probes`` (a dict to fill), every row with a tier below vLLM's own cache also measures
    :func:`load_vs_recompute` on its first engine after the workload.
    """
    out: dict[str, list[RequestRecord]] = {}
    for row in rows:
        t0 = time.monotonic()
        rwork = work / row
        rwork.mkdir(parents=True, exist_ok=True)
        try:
            with row_stack(row, sizes, model, max_model_len(cfg), rwork) as h:
                up = time.monotonic() - t0
                out.update(drive({LABELS[row]: (h.url, h.headers)}, cfg))
                if probes is not None and row != "L1":  # L1 has no tier to load from
                    probes[row] = load_vs_recompute(h.servers[0], cfg.prompt_tokens(cfg.rounds))
        except (RuntimeError, OSError, ValueError, httpx.HTTPError, AssertionError) as exc:
            print(f"row {row}: failed: {exc}", file=sys.stderr)
            continue
        print(f"row {row}: up in {up:.0f} s, ran in {time.monotonic() - t0 - up:.0f} s",
              file=sys.stderr)
    return out


def model_facts(model: str) -> dict[str, Any]:
    """The model's description and KV bytes per token (the load/recompute ratio is measured)."""
    return {"model": "random-weight Llama (fp32, " + ", ".join(f"{k} {v}" for k, v in MODEL.items())
            + ")", "kv_bytes_per_token": kv_bytes_per_token(), "model_dir": model}


def live(args: argparse.Namespace, cfg: MultiturnConfig, meta: dict[str, Any], drive: Drive,
         emit: Emit) -> int:
    """Run the live rows (and the sweep and simulation when asked); print and write everything.

    ``drive({label: (url, headers)}, cfg)`` runs the workload on a row with a progress bar;
    ``emit(rows, meta, predicted)`` prints the tables and writes the files.
    """
    sizes = replace(Sizes(), **json.loads(args.stack_json or "{}"))
    rows = row_list(args.rows)  # the arguments first: unknown rows fail up front
    sweep_rows = row_list(args.sweep_rows) if args.sweep else []
    if not os.access(VLLM_PYTHON, os.X_OK):
        print(f"no vLLM python at {VLLM_PYTHON}; set KVPLANE_VLLM_PYTHON", file=sys.stderr)
        return 2
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix="kvplane-multiturn-"))
    old = signal.signal(signal.SIGTERM, _on_sigterm)
    t0 = time.monotonic()
    try:
        model = str(make_model(work / "model", MODEL, timeout=600))
        before = report.host_load()
        probes: dict[str, Any] = {}
        results = run_rows(rows, cfg, sizes, model, work, drive, probes)
        meta["load_vs_recompute"] = probes
        meta.update(sizes=asdict(sizes), machine_before=before, machine=report.host_load(),
                    wall_s=time.monotonic() - t0, **model_facts(model))
        meta["working_set_mib_by_round"] = [
            round(cfg.working_set_tokens(r) * kv_bytes_per_token() / 2**20, 1)
            for r in range(1, cfg.rounds + 1)]
        predicted = _simulate(cfg, sizes, results, out) if args.simulate else None
        emit(results, meta, predicted)
        print(f"model: {meta['model']}, KV {meta['kv_bytes_per_token']} B/token")
        for row, pr in probes.items():
            print(f"load vs recompute on {row}: {pr['prompt_tokens']}-token prompt recomputed in "
                  f"{1000 * pr['recompute_s']:.0f} ms ({pr['recompute_ms_per_token']:.3f} ms/token), "
                  f"served again in {1000 * pr['hit_s']:.0f} ms with {pr['hit_tokens']} tokens "
                  f"cached: {pr['hit_over_recompute']:.3f}x")
        if sweep_rows:
            _sweep(args, cfg, sweep_rows, sizes, model, work, out, drive, meta)
        print(f"total wall {time.monotonic() - t0:.0f} s; logs in {work}", file=sys.stderr)
        return 0 if results else 1
    finally:
        signal.signal(signal.SIGTERM, old)
        if not os.environ.get("KVPLANE_KEEP_LOGS"):
            shutil.rmtree(work, ignore_errors=True)


def _sweep(args: argparse.Namespace, base: MultiturnConfig, rows: list[str], sizes: Sizes,
           model: str, work: pathlib.Path, out: pathlib.Path, drive: Drive,
           meta: dict[str, Any]) -> None:
    """Conversation counts grown past the L2 capacity: hit rate and TTFT of follow-up rounds.

    Each row starts once; every conversation count then runs on it with its own seed (fresh
    tokens: nothing of an earlier point can hit) after a reset of the engines' prefix caches.
    """
    counts = [int(x) for x in args.sweep.split(",")]
    points = []
    l2_total_mib = sizes.l2_mib * sizes.instances
    for row in rows:
        cfgs = [replace(base, clients=n, rounds=args.sweep_rounds, seed=base.seed + 1000 + n)
                for n in counts]
        rwork = work / f"sweep-{row}"
        rwork.mkdir(parents=True, exist_ok=True)
        try:
            with row_stack(row, sizes, model, max(max_model_len(c) for c in cfgs), rwork) as h:
                for cfg in cfgs:
                    for s in h.servers:
                        s.reset_prefix_cache()
                    recs = drive({f"{LABELS[row]}, {cfg.clients} conv.": (h.url, h.headers)}, cfg)
                    ws = cfg.working_set_tokens(cfg.rounds) * kv_bytes_per_token() / 2**20
                    points.append(report.crossover_point(LABELS[row], cfg.clients, ws,
                                                         next(iter(recs.values()))))
        except (RuntimeError, OSError, ValueError, httpx.HTTPError, AssertionError) as exc:
            print(f"sweep row {row}: failed: {exc}", file=sys.stderr)
    lines = ["| row | conversations | working set MiB | WS / L2 | hit rate r>=2 | TTFT p50 r>=2 ms |",
             "|---|---:|---:|---:|---:|---:|"]
    for p in points:
        hit = "-" if p.hit_rate is None else f"{100 * p.hit_rate:.1f}%"
        ttft = "-" if p.ttft_p50_s is None else f"{1000 * p.ttft_p50_s:.0f}"
        lines.append(f"| {p.row} | {p.clients} | {p.working_set_mib:.0f} | "
                     f"{p.working_set_mib / l2_total_mib:.2f} | {hit} | {ttft} |")
    print("\n".join(lines))
    (out / "multiturn_crossover.json").write_text(json.dumps(
        {"l2_capacity_mib": l2_total_mib, "points": [asdict(p) for p in points],
         "machine": report.host_load()}, indent=1))
    if not args.no_plots and points:
        report.plot_crossover(points, l2_total_mib, out / "multiturn_crossover.png",
                              f"Crossover: {args.sweep_rounds} rounds, L2 {sizes.l2_mib} MiB x "
                              f"{sizes.instances} instances")


def _simulate(cfg: MultiturnConfig, sizes: Sizes, results: dict[str, list[RequestRecord]],
              out: pathlib.Path) -> dict[str, dict[int, float]]:
    """``kvplane simulate`` on this run's trace: hit rate by round for L1, +L2 and +L3."""
    from tests.support.multiturn_sim import simulate_rows

    return simulate_rows(cfg, sizes, results, out, kv_bytes_per_token())
