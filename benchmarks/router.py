"""`kvplane router` on real vLLM CPU instances: a trace's prefix-sharing workload, policy by policy,
next to the simulator's prediction for the same workload.

Workload: whole multi-turn conversations of a Mooncake-format trace (default: the bundled sample),
earliest first, until ``--requests``; a request continues an earlier one when that one's complete
blocks prefix its ``hash_ids`` (as ``scheduling.trace.turns`` infers turns), so prefixes are
shared. Requests longer than ``--max-blocks`` blocks are left out. Each hash id maps to a fixed
random text block of ``--block-tokens`` words that the test tokenizer maps one-to-one to tokens
(512-token trace blocks shrunk to fit CPU prefill times); block hash ``h`` always gives the same
block. Arrivals keep the trace's order and gaps, compressed so that the offered prefill load
without any cache is ``--load`` of the instances' capacity under the fitted time model.

Time model: before the runs, prompts of several lengths are prefilled on one instance while the
others idle and ``T(n) = c0 + k1 n + k2 n^2`` is fitted by least squares to the median TTFTs
(streamed, ``max_tokens=1``); a mostly cached prompt checks the ``T(n, p)`` form. The simulator's
instances do not share CPUs, these do (3 instances on 2 cores, with whatever else runs there), so
the longest prompt is then prefilled on every instance at once and the fit is scaled by the
measured slowdown: that scaled model is what the routers and the simulator get, and what sets the
arrival rate. The routers get the fit (``--set
model.prefill_fit=c0,k1,k2``), and the simulator runs the same policy objects (built as the router
builds them: no rejection, no pulls) on 3 prefill instances whose GPU cache is the engines' KV
capacity in blocks, no DRAM tier, decode on separate instances (so it predicts TTFT only).

Per run: fresh prefix caches, one ``kvplane router`` process (CLI), an open-loop replay of
streamed completions; TTFT is measured at the client (first token event); the hit ratio is
vLLM's own ``prefix_cache_hits / prefix_cache_queries`` over the run. Policies run interleaved
``--repeat`` times; the table keeps each policy's best run (lowest TTFT mean) and lists every
run's mean.

Usage: python benchmarks/router.py [--requests 60] [--load 0.7] [--policies mooncake,least-loaded,round-robin]
       [--backend URL,events=..,replay=.. (x3) to use running servers with VLLM_SERVER_DEV_MODE=1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import secrets
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Any

import httpx
import numpy as np

from kvplane.common.procs import Proc
from kvplane.conductor.gateway.config import BackendSpec, GatewayConfig
from kvplane.conductor.gateway.server import sim_config
from kvplane.conductor.scheduling.outcomes import summarize
from kvplane.conductor.scheduling.simulator import Simulator
from kvplane.conductor.scheduling.trace import load_trace
from kvplane.conductor.scheduling.view import Request
from kvplane.data import SAMPLE_TRACE

# one token each in the test tokenizer, and short: vLLM refuses prompts of more than 4 characters
# per token of context before tokenizing them
WORDS = list(range(20, 100))
MODEL_SPEC = {"hidden": 768, "layers": 4, "heads": 12, "intermediate": 2048, "max_pos": 2048}


@dataclass(frozen=True)
class Item:
    """One replayed request: trace arrival (s, unscaled), hash ids, prompt text and length."""

    rid: int
    arrival_s: float
    hash_ids: tuple[int, ...]
    text: str
    tokens: int


def block_words(h: int, size: int) -> list[str]:
    """The fixed random text block of hash id ``h``."""
    rnd = random.Random(h * 7919 + 1)
    return [f"t{rnd.choice(WORDS)}" for _ in range(size)]


def workload(trace: str, n: int, block_tokens: int, max_blocks: int) -> list[Item]:
    """Whole multi-turn conversations of the trace, earliest first, until ``n`` requests."""
    reqs = [r for r in load_trace(trace) if r.hash_ids and len(r.hash_ids) <= max_blocks]
    tails: dict[int, int] = {}
    root: dict[int, int] = {}  # rid -> the first request of its conversation

    def find(rid: int) -> int:
        while root.get(rid, rid) != rid:
            rid = root[rid]
        return rid

    for r in reqs:
        for h in reversed(r.hash_ids):
            if h in tails:
                root[find(r.rid)] = find(tails[h])
                break
        full = r.input_length // 512
        if 2 <= full <= len(r.hash_ids):
            tails[r.hash_ids[full - 1]] = r.rid
    sessions: dict[int, list[Any]] = {}
    for r in reqs:
        sessions.setdefault(find(r.rid), []).append(r)
    chosen: list[Any] = []
    for members in sessions.values():  # in order of their first request
        if len(members) > 1 and len(chosen) < n:
            chosen += members
    chosen.sort(key=lambda r: (r.arrival_s, r.rid))
    t0 = chosen[0].arrival_s if chosen else 0.0
    return [Item(i, r.arrival_s - t0, r.hash_ids,
                 " ".join(w for h in r.hash_ids for w in block_words(h, block_tokens)),
                 len(r.hash_ids) * block_tokens) for i, r in enumerate(chosen)]


def ideal_hit_ratio(items: list[Item]) -> float:
    """Share of blocks an infinite cache shared by all instances would hit."""
    seen: set[int] = set()
    hit = total = 0
    for it in items:
        for h in it.hash_ids:
            hit += h in seen
            total += 1
        seen.update(it.hash_ids)
    return hit / total if total else 0.0


# instances --------------------------------------------------------------------------------------
def start_instances(count: int, max_model_len: int, tmp: pathlib.Path, model_dir: str | None) -> list[Any]:
    from tests.support.services import wait_until
    from tests.support.vllm_harness import OpenAIServer, make_model

    model = model_dir or str(make_model(tmp / "model", MODEL_SPEC, timeout=600))
    out = [OpenAIServer(model, tmp / f"vllm{i}.log", events=f"ipc://{tmp}/kv{i}",
                        replay=f"ipc://{tmp}/replay{i}", max_model_len=max_model_len, max_num_seqs=4)
           for i in range(count)]
    for s in out:
        wait_until(s.ready, 600, f"vLLM server {s.url}")
    return out


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30, trust_env=False).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{"))


def kv_capacity_tokens(url: str) -> int:
    text = httpx.get(url + "/metrics", timeout=30, trust_env=False).text
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            return int(line.split('kv_cache_size_tokens="', 1)[1].split('"', 1)[0])
    raise RuntimeError(f"{url} reports no cache_config_info")


def reset(urls: list[str]) -> None:
    for url in urls:
        httpx.post(url + "/reset_prefix_cache", timeout=60, trust_env=False).raise_for_status()


async def ttft(client: httpx.AsyncClient, url: str, text: str, max_tokens: int) -> tuple[float, str]:
    """Seconds to the first streamed token, and the backend that served it (router header)."""
    body = {"model": "tiny", "prompt": text, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    first = None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                if '"error"' in line:
                    raise RuntimeError(line[:300])
                first = time.perf_counter() - start
        return (first if first is not None else float("nan")), r.headers.get("x-kvplane-backend", "")


# the fit ------------------------------------------------------------------------------------------
async def _prefill_round(urls: list[str], n: int, seed: int) -> list[float]:
    """TTFTs of one uncached ``n``-token prompt sent to each of ``urls`` at the same time."""
    async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
        texts = [" ".join(block_words(10**9 + seed * 100 + i, n)) for i in range(len(urls))]
        got = await asyncio.gather(*(ttft(client, u, t, 1) for u, t in zip(urls, texts)))
        return [g[0] for g in got]


def fit(urls: list[str], lengths: list[int], reps: int) -> tuple[tuple[float, float, float], list[str]]:
    """Fit T(n) = c0 + k1 n + k2 n^2 on one instance (others idle), scale it by the slowdown
    measured with every instance prefilling at once, and check a mostly cached prompt."""
    rows, xs, ys = [], [], []
    for n in lengths:
        samples = [t for rep in range(reps) for t in asyncio.run(_prefill_round(urls[:1], n, n * 10 + rep))]
        xs.append(n)
        ys.append(statistics.median(samples))
        rows.append(f"  n={n:5d}: median TTFT {ys[-1] * 1e3:7.1f} ms over {len(samples)} prefills")
    a = np.array([[1.0, x, x * x] for x in xs])
    c0, k1, k2 = (max(0.0, float(c)) for c in np.linalg.lstsq(a, np.array(ys), rcond=None)[0])
    pred = [c0 + k1 * x + k2 * x * x for x in xs]
    rows.append("  fit: c0=%.4f s, k1=%.3e s/token, k2=%.3e s/token^2; max error %.0f%%"
                % (c0, k1, k2, 100 * max(abs(p - y) / y for p, y in zip(pred, ys))))
    rows.append(cached_check(urls[0], max(lengths), (c0, k1, k2)))
    factor, line = slowdown(urls, max(lengths), reps)
    rows.append(line)
    return (c0 * factor, k1 * factor, k2 * factor), rows


def slowdown(urls: list[str], n: int, reps: int) -> tuple[float, str]:
    """How much slower a prefill is when every instance prefills at once (shared cores)."""
    alone, together = [], []
    for rep in range(reps):
        alone += asyncio.run(_prefill_round(urls[:1], n, 7000 + rep))
        together += asyncio.run(_prefill_round(urls, n, 8000 + rep))
    factor = max(1.0, statistics.median(together) / statistics.median(alone))
    return factor, (f"  slowdown with all {len(urls)} instances prefilling n={n} at once: "
                    f"x{factor:.2f} (median {statistics.median(together) * 1e3:.0f} ms vs "
                    f"{statistics.median(alone) * 1e3:.0f} ms alone); the model used below is the "
                    f"fit times x{factor:.2f}")


def cached_check(url: str, n: int, coef: tuple[float, float, float]) -> str:
    """TTFT of a prompt whose first n - 32 tokens are cached, measured vs T(n, p)."""
    c0, k1, k2 = coef
    base = block_words(2 * 10**9, n - 32)

    async def go() -> float:
        async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
            await ttft(client, url, " ".join(base + block_words(2 * 10**9 + 1, 32)), 1)
            out = []
            for i in range(3):
                text = " ".join(base + block_words(2 * 10**9 + 2 + i, 32))
                out.append((await ttft(client, url, text, 1))[0])
            return statistics.median(out)

    got = asyncio.run(go())
    p = n - 32
    want = c0 + k1 * (n - p) + k2 * (n * n - p * p)
    return (f"  check: n={n} with {p} cached: measured {got * 1e3:.1f} ms, T(n, p) predicts "
            f"{want * 1e3:.1f} ms (one instance, the others idle)")


# one policy ---------------------------------------------------------------------------------------
ROUTER_TOKEN = secrets.token_urlsafe(24)
ROUTER_AUTH = {"Authorization": f"Bearer {ROUTER_TOKEN}"}


def run_policy(policy: str, specs: list[str], urls: list[str], items: list[Item], speed: float,
               coef: tuple[float, float, float], max_tokens: int) -> dict[str, Any]:
    reset(urls)
    q0 = {u: metric(u, "vllm:prefix_cache_queries_total") for u in urls}
    h0 = {u: metric(u, "vllm:prefix_cache_hits_total") for u in urls}
    # the router is secure by default: this run's own token, sent by the replay client
    argv = [sys.executable, "-m", "kvplane.cli.router", "--policy", policy, "--port", "0",
            "--token", ROUTER_TOKEN, "--set", "model.prefill_fit=%r,%r,%r" % coef]
    for s in specs:
        argv += ["--backend", s]
    router = Proc(argv, ready_timeout=60, stop_signal=15)
    try:
        url = router.info["router"]
        wait_all_up(url, len(urls))
        results = asyncio.run(replay(url, items, speed, max_tokens))
    finally:
        router.stop(30)
    queries = sum(metric(u, "vllm:prefix_cache_queries_total") - q0[u] for u in urls)
    hits = sum(metric(u, "vllm:prefix_cache_hits_total") - h0[u] for u in urls)
    ok = [r for r in results if isinstance(r, tuple)]
    ttfts = np.array([r[0] for r in ok])
    spread: dict[str, int] = {}
    for _, backend in ok:
        spread[backend] = spread.get(backend, 0) + 1
    return {"policy": policy, "requests": len(items), "errors": len(results) - len(ok),
            "ttft_mean_s": float(np.mean(ttfts)) if len(ttfts) else None,
            "ttft_p90_s": float(np.percentile(ttfts, 90)) if len(ttfts) else None,
            "hit_ratio": hits / queries if queries else 0.0,
            "spread": sorted(spread.values(), reverse=True)}


def _s(seconds: float | None) -> str:
    """Seconds for a progress line ("n/a" when every request of the run failed)."""
    return "n/a" if seconds is None else f"{seconds:.3f} s"


def wait_all_up(url: str, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = httpx.get(url + "/health", timeout=5, trust_env=False).json()
        if h.get("backends_up") == n and h.get("block_size"):
            return
        time.sleep(0.2)  # readiness poll of the router's own health answer
    raise RuntimeError(f"router {url}: not all {n} backends up within {timeout}s")


async def replay(url: str, items: list[Item], speed: float, max_tokens: int) -> list[Any]:
    async with httpx.AsyncClient(timeout=600, trust_env=False, headers=ROUTER_AUTH,
                                 limits=httpx.Limits(max_connections=1000)) as client:
        start = time.perf_counter()

        async def one(it: Item) -> tuple[float, str]:
            await asyncio.sleep(max(0.0, start + it.arrival_s / speed - time.perf_counter()))
            return await ttft(client, url, it.text, max_tokens)

        return await asyncio.gather(*(one(it) for it in items), return_exceptions=True)


# the simulator's prediction -------------------------------------------------------------------------
def simulate(policy: str, items: list[Item], speed: float, coef: tuple[float, float, float],
             instances: int, block_tokens: int, kv_tokens: int, max_tokens: int) -> dict[str, Any]:
    """The same policy object as the router builds it, on the simulated cluster of the module doc."""
    name, cfg = sim_config(GatewayConfig(backends=(BackendSpec("http://sim:1"),), policy=policy,
                                         block_size=block_tokens,
                                         settings=(("model.prefill_fit", "%r,%r,%r" % coef),)))
    cluster = replace(cfg.cluster, prefill_instances=instances, decode_instances=instances,
                      gpu_cache_blocks=kv_tokens // block_tokens, cpu_cache_blocks=0, pool_blocks=0)
    reqs = [Request(it.rid, it.arrival_s / speed, it.tokens, max_tokens, it.hash_ids) for it in items]
    res = Simulator(replace(cfg, cluster=cluster), name).run(reqs)
    row = summarize(res.outcomes, cfg.slo)
    return {"ttft_mean_s": row["ttft_mean_s"], "ttft_p90_s": row["ttft_p90_s"],
            "hit_ratio": row["hit_ratio"]}


# main -----------------------------------------------------------------------------------------------
def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=str(SAMPLE_TRACE))
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--block-tokens", type=int, default=32, help="tokens per trace block (= vLLM block)")
    p.add_argument("--max-blocks", type=int, default=24)
    p.add_argument("--load", type=float, default=0.5, help="offered uncached prefill load per instance")
    p.add_argument("--repeat", type=int, default=3, help="runs per policy, interleaved; the best is kept")
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--policies", default="mooncake,least-loaded,round-robin")
    p.add_argument("--instances", type=int, default=3)
    p.add_argument("--fit-lengths", default="", help="comma separated (default: 1,4,8,.. blocks)")
    p.add_argument("--fit-reps", type=int, default=3)
    p.add_argument("--model-dir", default=None, help="model to serve (default: a random-weight "
                   f"Llama {MODEL_SPEC} written by the vLLM venv)")
    p.add_argument("--backend", action="append", default=[],
                   help="use running servers (router backend spec with events=,replay=)")
    p.add_argument("--json", default="", help="also write the rows to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    bt = args.block_tokens
    items = workload(args.trace, args.requests, bt, args.max_blocks)
    if not items:
        print("no multi-turn requests in the trace under --max-blocks")
        return 1
    with tempfile.TemporaryDirectory(prefix="kvplane-bench-router-") as tmpdir:
        tmp = pathlib.Path(tmpdir)
        servers: list[Any] = []
        specs = list(args.backend)
        if not specs:
            servers = start_instances(args.instances, max(2048, args.max_blocks * bt + 64), tmp,
                                      args.model_dir)
            specs = [f"{s.url},events=ipc://{tmp}/kv{i},replay=ipc://{tmp}/replay{i}"
                     for i, s in enumerate(servers)]
        try:
            return report(args, items, specs)
        finally:
            for s in servers:
                s.close()


def report(args: argparse.Namespace, items: list[Item], specs: list[str]) -> int:
    bt = args.block_tokens
    urls = [BackendSpec.parse(s).url for s in specs]
    lengths = ([int(x) for x in args.fit_lengths.split(",")] if args.fit_lengths
               else sorted({bt, 4 * bt, 8 * bt, 16 * bt, args.max_blocks * bt}))
    reset(urls)
    coef, fit_rows = fit(urls, lengths, args.fit_reps)
    reset(urls)
    c0, k1, k2 = coef
    mean_work = statistics.mean(c0 + k1 * it.tokens + k2 * it.tokens ** 2 for it in items)
    span = max(items[-1].arrival_s, 1e-9)
    speed = span * len(urls) * args.load / (len(items) * mean_work)
    kv = kv_capacity_tokens(urls[0])
    print("load average (1 min) at the start: %.1f on %d CPUs" % (os.getloadavg()[0], os.cpu_count() or 0))
    print(f"workload: {len(items)} requests of multi-turn chains from {pathlib.Path(args.trace).name}, "
          f"{bt} tokens per trace block, prompts {min(i.tokens for i in items)}-"
          f"{max(i.tokens for i in items)} tokens (mean {statistics.mean(i.tokens for i in items):.0f}), "
          f"ideal hit ratio {ideal_hit_ratio(items):.1%}")
    print(f"arrivals: trace span {span:.0f} s compressed x{speed:.1f} to {span / speed:.1f} s "
          f"(offered uncached load {args.load:.2f} of {len(urls)} instances); max_tokens {args.max_tokens}")
    print(f"engine KV capacity: {kv} tokens = {kv // bt} blocks per instance (the simulator's GPU cache)")
    print("time model (fitted on one instance, the others idle):")
    print("\n".join(fit_rows))
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    for rep in range(args.repeat):  # interleaved, so each policy sees the same drift of the host
        for policy in policies:
            got = run_policy(policy, specs, urls, items, speed, coef, args.max_tokens)
            runs[policy].append(got)
            print(f"  run {rep + 1}/{args.repeat} {policy}: TTFT mean {_s(got['ttft_mean_s'])}, "
                  f"p90 {_s(got['ttft_p90_s'])}, hit {got['hit_ratio']:.1%}, errors {got['errors']}, "
                  f"load average {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    for policy in policies:
        best = min(runs[policy], key=lambda r: r["ttft_mean_s"] if r["ttft_mean_s"] is not None else 1e9)
        sim = simulate(policy, items, speed, coef, len(urls), bt, kv, args.max_tokens)
        rows.append({**best, "errors": sum(r["errors"] for r in runs[policy]),
                     "runs_ttft_mean_s": [r["ttft_mean_s"] for r in runs[policy]],
                     "runs_hit_ratio": [r["hit_ratio"] for r in runs[policy]], "sim": sim})
    table(rows)
    print("load average (1 min) at the end: %.1f on %d CPUs" % (os.getloadavg()[0], os.cpu_count() or 0))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    print(json.dumps(rows))
    return 0 if all(r["errors"] == 0 for r in rows) else 2


def table(rows: list[dict[str, Any]]) -> None:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:8.0f}"

    print(f"\n{'policy':14s} | {'TTFT mean ms':>12s} | {'p90 ms':>8s} | {'hit (vLLM)':>10s} | "
          f"{'errors':>6s} | {'spread':14s} || {'sim mean ms':>11s} | {'sim p90':>8s} | {'sim hit':>7s}")
    for r in rows:
        s = r["sim"]
        print(f"{r['policy']:14s} | {ms(r['ttft_mean_s']):>12s} | {ms(r['ttft_p90_s']):>8s} | "
              f"{r['hit_ratio']:10.1%} | {r['errors']:6d} | {str(r['spread']):14s} || "
              f"{ms(s['ttft_mean_s']):>11s} | {ms(s['ttft_p90_s']):>8s} | {s['hit_ratio']:7.1%}")
    for r in rows:
        print(f"{r['policy']}: every run's TTFT mean (s) "
              + ", ".join(f"{v:.3f}" for v in r["runs_ttft_mean_s"] if v is not None)
              + "; hit " + ", ".join(f"{v:.1%}" for v in r["runs_hit_ratio"]))
    base = next((r for r in rows if r["policy"] == "round-robin"), None)
    if base and base["ttft_mean_s"]:
        for r in rows:
            if r is not base and r["ttft_mean_s"] and r["sim"]["ttft_mean_s"]:
                print(f"round-robin / {r['policy']}: measured TTFT mean x"
                      f"{base['ttft_mean_s'] / r['ttft_mean_s']:.2f}, simulated x"
                      f"{base['sim']['ttft_mean_s'] / r['sim']['ttft_mean_s']:.2f}")
    for r in rows:
        if r["ttft_mean_s"] and r["sim"]["ttft_mean_s"]:
            ratio = r["sim"]["ttft_mean_s"] / r["ttft_mean_s"]
            print(f"{r['policy']}: simulated / measured TTFT mean {ratio:.2f}")


if __name__ == "__main__":
    sys.exit(main())
