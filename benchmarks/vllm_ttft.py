"""vLLM TTFT with a repeated long prompt: kvplane hit vs recompute vs Mooncake, in one run.

Two real vLLM CPU engines (vLLM 0.32, the venv at KVPLANE_VLLM_PYTHON) serve the same random-
weight float32 Llama: one with ``KVPlaneStoreConnector`` on a kvplane master + ``kvplane segment``
process, one with vLLM's own ``MooncakeStoreConnector`` on a real ``mooncake_master`` (the
Mooncake wheel's venv, ``--mooncake-venv``; that engine contributes its own segment, Mooncake's
"embedded" mode). For each of ``--repeats`` fresh prompts each engine serves the prompt once
(a miss: full recompute, saved in the background), its local prefix cache is reset, and it serves
the prompt again (a hit in the external store). TTFT is the wall time of ``LLM.generate`` with
``max_tokens=1`` inside the engine process; medians are reported. Everything binds 127.0.0.1.

Usage: python benchmarks/vllm_ttft.py [--prompt-tokens 2000] [--repeats 3] [--no-mooncake]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
from typing import Any

import httpx

from tests.support.auth import headers
from tests.support.services import free_port, wait_until
from tests.support.store_procs import spawn_master, spawn_segment
from tests.support.vllm_harness import BS, VLLM_PYTHON, Driver, make_model, store_kv_config, vllm_env

MODELS = {"tiny": {"hidden": 128, "layers": 2, "heads": 2, "intermediate": 256, "max_pos": 4096},
          "small": {"hidden": 512, "layers": 4, "heads": 8, "intermediate": 1536, "max_pos": 4096}}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", choices=sorted(MODELS), default="small")
    ap.add_argument("--mooncake-venv", default=os.environ.get("KVPLANE_MOONCAKE_VENV", "/tmp/mc-venv"))
    ap.add_argument("--no-mooncake", action="store_true", help="only kvplane (and recompute)")
    ap.add_argument("--kvplane-protocol", default="auto", help="auto (shm on one host) or tcp")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    return ap.parse_args(argv)


def tokens_for(seed: int, n: int) -> list[int]:
    return [(i * 7919 + seed * 104729) % 997 + 1 for i in range(n)]


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class MooncakeMaster:
    """``mooncake_master`` with its embedded HTTP metadata server, on free loopback ports."""

    def __init__(self, venv: str, log: pathlib.Path) -> None:
        self.rpc, self.http, self.metrics = free_port(), free_port(), free_port()
        exe = os.path.join(venv, "bin", "mooncake_master")
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [exe, "-rpc_address=127.0.0.1", f"-rpc_port={self.rpc}",
             "-enable_http_metadata_server=true", "-http_metadata_server_host=127.0.0.1",
             f"-http_metadata_server_port={self.http}", "-metrics_host=127.0.0.1",
             f"-metrics_port={self.metrics}"], stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "GLOG_minloglevel": "1", "MC_TCP_BIND_ADDRESS": "127.0.0.1"})
        wait_until(lambda: self._alive() and port_open(self.rpc) and port_open(self.http), 30,
                   "mooncake_master")

    def _alive(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError("mooncake_master exited; see " + self.log.name)
        return True

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def mooncake_engine(venv: str, master: MooncakeMaster, model: str, max_len: int,
                    work: pathlib.Path) -> Driver:
    """A vLLM engine with MooncakeStoreConnector; ``mooncake`` comes from the Mooncake venv."""
    site = pathlib.Path(venv) / "lib" / "python3.11" / "site-packages"
    link = work / "mcpath"
    link.mkdir(exist_ok=True)
    for name in ("mooncake", "mooncake_transfer_engine_non_cuda.libs"):
        if (site / name).exists() and not (link / name).exists():
            (link / name).symlink_to(site / name)
    cfg_path = work / "mooncake.json"
    cfg_path.write_text(json.dumps({
        "metadata_server": f"http://127.0.0.1:{master.http}/metadata",
        "master_server_address": f"127.0.0.1:{master.rpc}", "protocol": "tcp", "device_name": "",
        "global_segment_size": "1GB", "local_buffer_size": "256MB"}))
    env = vllm_env(str(link), MOONCAKE_CONFIG_PATH=str(cfg_path), MC_TCP_BIND_ADDRESS="127.0.0.1",
                   GLOG_minloglevel="1")
    cfg = {"model_dir": model, "max_model_len": max_len,
           "kv_transfer_config": {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}}
    return Driver(work / "mooncake-engine.log", cfg, env)


def measure(eng: Driver, prompts: list[list[int]], expect_hit: int,
            saved: Any = None) -> dict[str, Any]:
    """Miss then hit TTFT for each prompt (local prefix cache reset in between)."""
    eng.generate([5, 6, 7], 1)
    eng.generate([5, 6, 7], 1)  # warm-up
    miss, hit, hit_tokens = [], [], []
    for i, p in enumerate(prompts):
        r = eng.generate(p, 1, timeout=300)
        miss.append(r["elapsed_s"])
        if saved is not None:
            wait_until(lambda: saved(i), 60, "saves in the store")  # noqa: B023  (called in this iteration)
        for _ in range(3):  # a background save may still be landing
            eng.call(60, op="reset")
            r = eng.generate(p, 1, timeout=300)
            if r["num_cached_tokens"] >= expect_hit:
                break
        hit.append(r["elapsed_s"])
        hit_tokens.append(r["num_cached_tokens"])
    return {"recompute_ms": statistics.median(miss) * 1e3, "hit_ms": statistics.median(hit) * 1e3,
            "hit_tokens": min(hit_tokens), "recompute_all_ms": [x * 1e3 for x in miss],
            "hit_all_ms": [x * 1e3 for x in hit]}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not os.access(VLLM_PYTHON, os.X_OK):
        print(f"no vLLM python at {VLLM_PYTHON}; set KVPLANE_VLLM_PYTHON", file=sys.stderr)
        return 2
    master_exe = os.path.join(args.mooncake_venv, "bin", "mooncake_master")
    use_mc = not args.no_mooncake and os.path.exists(master_exe)
    work = pathlib.Path(tempfile.mkdtemp(prefix="kvplane-ttft-"))
    max_len = args.prompt_tokens + 64
    n_blocks = (args.prompt_tokens - 1) // BS
    layers = MODELS[args.model]["layers"]
    prompts = [tokens_for(s + 1, args.prompt_tokens) for s in range(args.repeats)]
    master = segment = mc = None
    engines: dict[str, Driver] = {}
    try:
        model = str(make_model(work / "model", MODELS[args.model]))
        master = spawn_master()
        segment = spawn_segment(master.info["master"], "2GiB")
        admin = f"http://127.0.0.1:{master.info['admin_port']}"
        kv = store_kv_config(master.info["master"], protocol=args.kvplane_protocol)
        engines["kvplane"] = Driver(work / "kvplane-engine.log",
                                    {"model_dir": model, "max_model_len": max_len, "kv_transfer_config": kv})
        if use_mc:
            mc = MooncakeMaster(args.mooncake_venv, work / "mooncake-master.log")
            engines["mooncake"] = mooncake_engine(args.mooncake_venv, mc, model, max_len, work)
        for eng in engines.values():
            eng.ready()

        def kv_saved(i: int) -> bool:
            keys = httpx.get(f"{admin}/get_all_keys", timeout=5, trust_env=False,
                             headers=headers()).json()
            return len(keys) >= (i + 1) * n_blocks * layers

        results = {"kvplane": measure(engines["kvplane"], prompts, n_blocks * BS, kv_saved)}
        if use_mc:
            results["mooncake"] = measure(engines["mooncake"], prompts, n_blocks * BS)
        report(args, results, n_blocks * BS, use_mc)
        if args.out:
            pathlib.Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
        return 0
    finally:
        for eng in engines.values():
            eng.close()
        if segment is not None:
            segment.stop()
        if master is not None:
            master.stop()
        if mc is not None:
            mc.stop()
        shutil.rmtree(work, ignore_errors=True)


def report(args: argparse.Namespace, results: dict[str, Any], loadable: int, use_mc: bool) -> None:
    spec = MODELS[args.model]
    print(f"vLLM TTFT, prompt {args.prompt_tokens} tokens ({loadable} loadable), model {args.model} "
          f"({spec['layers']} layers, hidden {spec['hidden']}, fp32), median of {args.repeats}")
    print(f"{'connector':<28} | {'recompute ms':>12} | {'store hit ms':>12} | {'hit tokens':>10} | speedup")
    names = {"kvplane": f"KVPlaneStoreConnector ({args.kvplane_protocol})",
             "mooncake": "MooncakeStoreConnector (tcp)"}
    for key, r in results.items():
        print(f"{names[key]:<28} | {r['recompute_ms']:>12.1f} | {r['hit_ms']:>12.1f} | "
              f"{r['hit_tokens']:>10} | {r['recompute_ms'] / r['hit_ms']:.2f}x")
    if not use_mc:
        print("mooncake: skipped (no --mooncake-venv with bin/mooncake_master, or --no-mooncake)")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
