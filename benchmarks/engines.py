"""SGLang and LMCache storage backends, side by side: kvplane native vs the engine's own Mooncake
backend on kvplane vs the same backend on real Mooncake, in one run.

Each side is a batch store, a batch exists and a batch load of N pages (SGLang HiCache: pages of
``--page`` tokens through the backend's zero-copy ``batch_set_v1``/``batch_exists``/
``batch_get_v1``, 128 pages per call as the HiCache controller batches them) or N chunks
(LMCache: ``--chunk``-token chunks through the remote connector's ``batched_put``/
``batched_contains``/``batched_get``), timed inside the engine process (the engines venv), with
fresh keys per run, after an untimed full-size warm-up in the same engine instance, and every
load checked bit-exact. The sides run interleaved: ``--repeat`` rounds, each side once per round
(the order rotates), medians reported. Each side has its own pool for the whole run, emptied
(untimed) after every run, so runs reuse memory the store has already touched (kvplane's segment
faults its pages in at start, Mooncake's store server does not). Every side gets its own store: a kvplane
master + ``kvplane segment`` process, or a ``mooncake_master`` + ``mooncake_client`` store server
(real Mooncake 0.3.13.post1 from ``<engines venv>/mooncake-real``; skipped with the reason when
absent). The engine side is a pure client (no segment of its own); everything is on 127.0.0.1.

Usage: python benchmarks/engines.py [--engines sglang,lmcache] [--pages 32] [--chunks 8]
       [--geometry llama8b] [--repeat 5] [--protocol tcp] [--no-real] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from tests.support.engines_harness import (
    ENGINES_PYTHON,
    REAL_MOONCAKE,
    EngineDriver,
    real_mooncake_reason,
)
from tests.support.mooncake_real import RealMooncake
from tests.support.store_procs import spawn_master, spawn_segment

GEOMETRIES = {  # per-token KV: 2 x layers x heads x head_dim x itemsize
    "llama8b": {"layers": 32, "heads": 8, "head_dim": 128, "dtype": "bfloat16"},  # 128 KiB
    "tiny": {"layers": 2, "heads": 2, "head_dim": 64, "dtype": "float32"},  # 2 KiB
}
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
SGLANG_NATIVE = {"backend_name": "kvplane", "module_path": "kvplane.integrations.sglang.hicache",
                 "class_name": "KVPlaneHiCacheStorage", "interface_v1": True}
PLUGIN = "remote_storage_plugin.kvplane."
REAL_VERSION = "0.3.13.post1"  # the wheel .ci/setup-30-engines-venv.sh installs


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="sglang,lmcache")
    ap.add_argument("--pages", type=int, default=32, help="SGLang pages per batch run")
    ap.add_argument("--page", type=int, default=64, help="SGLang page size (tokens)")
    ap.add_argument("--chunks", type=int, default=8, help="LMCache chunks per batch run")
    ap.add_argument("--chunk", type=int, default=256, help="LMCache chunk size (tokens)")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="llama8b")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per side (after a warm-up)")
    ap.add_argument("--protocol", default="tcp", help="kvplane sides: tcp, or auto (shm)")
    ap.add_argument("--no-real", action="store_true", help="skip real Mooncake")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    return ap.parse_args(argv)


def token_bytes(geometry: str) -> int:
    g = GEOMETRIES[geometry]
    return 2 * g["layers"] * g["heads"] * g["head_dim"] * ITEMSIZE[g["dtype"]]


# -- the sides ------------------------------------------------------------------------------------
def sglang_sides(args: argparse.Namespace) -> list[dict[str, Any]]:
    def mooncake(store: dict[str, str]) -> dict[str, Any]:
        return {"backend": "mooncake", "extra": {
            "master_server_address": store["master"], "metadata_server": store["metadata"],
            "protocol": "tcp", "global_segment_size": "0", "local_buffer_size": "16777216"}}

    return [
        {"name": f"kvplane native (dynamic, {args.protocol})", "mooncake": "kvplane",
         "args": lambda s: {"backend": "dynamic", "extra": {
             **SGLANG_NATIVE, "master_server_address": s["master"], "protocol": args.protocol}}},
        {"name": "MooncakeStore on kvplane (tcp)", "mooncake": "kvplane", "args": mooncake},
        {"name": f"MooncakeStore on Mooncake {REAL_VERSION} (tcp)", "mooncake": "real",
         "args": mooncake},
    ]


def lmcache_sides(args: argparse.Namespace) -> list[dict[str, Any]]:
    def mooncake(zero_copy: bool) -> Any:
        def cfg(store: dict[str, str]) -> dict[str, Any]:
            extra = {"master_server_address": store["master"],
                     "mooncake_master_server_addr": store["master"],
                     "metadata_server": store["metadata"], "protocol": "tcp",
                     "global_segment_size": "0", "local_hostname": "127.0.0.1",
                     # LMCache's own put deadline (default 1 s) cuts 256 MiB batches short on
                     # real Mooncake here: the objects never complete and every load misses
                     "transfer_timeout": 120}
            if zero_copy:
                extra["save_chunk_meta"] = False
            return {"config": {"remote_url": f"mooncakestore://{store['master']}/",
                               "extra_config": extra}}
        return cfg

    native = lambda s: {"config": {"remote_storage_plugins": ["kvplane"], "extra_config": {  # noqa: E731
        PLUGIN + "module_path": "kvplane.integrations.lmcache",
        PLUGIN + "class_name": "KVPlaneConnectorAdapter", PLUGIN + "url": f"kvplane://{s['master']}",
        PLUGIN + "protocol": args.protocol}}}
    return [
        {"name": f"kvplane native (plugin, {args.protocol})", "mooncake": "kvplane", "args": native},
        {"name": "mooncakestore on kvplane (default)", "mooncake": "kvplane", "args": mooncake(False)},
        {"name": "mooncakestore on kvplane (save_chunk_meta=false)", "mooncake": "kvplane",
         "args": mooncake(True)},
        {"name": f"mooncakestore on Mooncake {REAL_VERSION} (default)", "mooncake": "real",
         "args": mooncake(False)},
        {"name": f"mooncakestore on Mooncake {REAL_VERSION} (save_chunk_meta=false)",
         "mooncake": "real", "args": mooncake(True)},
    ]


@contextlib.contextmanager
def fresh_store(kind: str, nbytes: int, work: pathlib.Path) -> Iterator[dict[str, str]]:
    """A new, empty pool of ``nbytes``: kvplane (master + segment) or real Mooncake."""
    mib = max(64, -(-nbytes // (1 << 20)))
    if kind == "real":
        with RealMooncake(REAL_MOONCAKE / "mooncake", work, f"{mib} MB") as mc:
            yield {"master": mc.master, "metadata": mc.metadata}
        return
    master = spawn_master()
    try:
        segment = spawn_segment(master.info["master"], f"{mib}MiB")
        try:
            yield {"master": master.info["master"], "metadata": "P2PHANDSHAKE"}
        finally:
            segment.stop()
    finally:
        master.stop()


def run_engine(engine: str, args: argparse.Namespace, drivers: dict[str, EngineDriver],
               real_reason: str | None, work: pathlib.Path) -> list[dict[str, Any]]:
    """Every side's pool up at once; ``--repeat`` rounds, each running every side once (the
    order rotates per round), so a burst of load on the shared box hits all sides alike."""
    n, unit, sides, op = plan(engine, args, drivers)
    rows = [{"engine": engine, "side": side["name"], "units": n, "unit_bytes": unit}
            for side in sides]
    live = [i for i, side in enumerate(sides) if not (side["mooncake"] == "real" and real_reason)]
    for i in set(range(len(sides))) - set(live):
        rows[i]["skipped"] = real_reason
    runs: dict[int, list[dict[str, Any]]] = {i: [] for i in live}
    with contextlib.ExitStack() as stack:
        # a call writes a warm-up and a timed run; the pool is emptied after each (forced
        # removal: kvplane reuses leased space once the pool is full)
        stores = {i: stack.enter_context(fresh_store(sides[i]["mooncake"], 3 * n * unit, work))
                  for i in live}
        for r in range(args.repeat):
            for i in live[r % len(live):] + live[:r % len(live)]:
                runs[i] += op(sides[i], stores[i])["runs"]
    for i in live:
        rows[i].update(summarise(runs[i], n * unit))
    return rows


def plan(engine: str, args: argparse.Namespace, drivers: dict[str, EngineDriver]) -> tuple[Any, ...]:
    """(units per run, bytes per unit, sides, op(side, store) -> the driver's bench reply)."""
    geo = GEOMETRIES[args.geometry]
    if engine == "sglang":
        n, unit = args.pages, args.page * token_bytes(args.geometry)

        def op(side: dict[str, Any], store: dict[str, str]) -> dict[str, Any]:
            return drivers[side["mooncake"]].call(
                "bench", timeout=1800, pages=n, repeat=1,
                geometry={**geo, "page": args.page, "tokens": 2 * args.page}, **side["args"](store))
        return n, unit, sglang_sides(args), op
    n, unit = args.chunks, args.chunk * token_bytes(args.geometry)
    cpu_gb = round((2 * n + 4) * unit * 1.5 / (1 << 30) + 0.05, 3)

    def op(side: dict[str, Any], store: dict[str, str]) -> dict[str, Any]:
        a = side["args"](store)
        a["config"]["max_local_cpu_size"] = cpu_gb
        return drivers[side["mooncake"]].call(
            "bench", timeout=1800, chunks=n, repeat=1,
            geometry={**geo, "chunk": args.chunk, "slots": args.chunk}, **a)
    return n, unit, lmcache_sides(args), op


def summarise(runs: list[dict[str, Any]], nbytes: int) -> dict[str, Any]:
    med = {k: statistics.median(r[k] for r in runs) for k in ("store", "exists", "load")}
    return {"store_s": med["store"], "exists_s": med["exists"], "load_s": med["load"],
            "best_store_s": min(r["store"] for r in runs), "best_load_s": min(r["load"] for r in runs),
            "store_gbps": nbytes / med["store"] / 1e9, "load_gbps": nbytes / med["load"] / 1e9,
            "ok": all(r["ok"] for r in runs), "bit_exact": all(r["bit_exact"] for r in runs),
            "runs": runs}


# -- report ---------------------------------------------------------------------------------------
def report(engine: str, rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    unit = rows[0]["unit_bytes"]
    what = (f"{args.pages} pages x {unit / (1 << 20):.2f} MiB (page {args.page} tokens)"
            if engine == "sglang" else
            f"{args.chunks} chunks x {unit / (1 << 20):.2f} MiB (chunk {args.chunk} tokens)")
    print(f"\n{engine}: batch store / exists / load of {what}, geometry {args.geometry}, "
          f"median of {args.repeat} interleaved rounds (best store/load in brackets)")
    print(f"{'backend':<58} | {'store ms':>9} | {'exists ms':>9} | {'load ms':>9} | "
          f"{'store GB/s':>10} | {'load GB/s':>9} | bit-exact | best ms")
    for r in rows:
        if "skipped" in r:
            print(f"{r['side']:<58} | skipped: {r['skipped']}")
            continue
        exact = "yes" if r["bit_exact"] and r["ok"] else "NO"
        print(f"{r['side']:<58} | {r['store_s'] * 1e3:>9.1f} | {r['exists_s'] * 1e3:>9.2f} | "
              f"{r['load_s'] * 1e3:>9.1f} | {r['store_gbps']:>10.2f} | {r['load_gbps']:>9.2f} | "
              f"{exact:<9} | [{r['best_store_s'] * 1e3:.1f} / {r['best_load_s'] * 1e3:.1f}]")
    base = rows[0]
    for r in rows[1:]:
        if "skipped" not in r and "skipped" not in base:
            print(f"ratio {r['side']} / native: store {r['store_s'] / base['store_s']:.2f}x, "
                  f"load {r['load_s'] / base['load_s']:.2f}x (time; > 1 = native faster)")
    by_side = {r["side"]: r for r in rows}
    for r in rows:  # the same Mooncake backend: real Mooncake against kvplane
        twin = by_side.get(r["side"].replace(f"on Mooncake {REAL_VERSION}", "on kvplane"))
        if REAL_VERSION in r["side"] and twin and "skipped" not in r and "skipped" not in twin:
            print(f"ratio {r['side']} / {twin['side']}: store {r['store_s'] / twin['store_s']:.2f}x, "
                  f"load {r['load_s'] / twin['load_s']:.2f}x (time; > 1 = kvplane faster)")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not os.access(ENGINES_PYTHON, os.X_OK):
        print(f"no engines venv python at {ENGINES_PYTHON}; run .ci/setup-30-engines-venv.sh",
              file=sys.stderr)
        return 2
    engines = [e for e in args.engines.split(",") if e]
    real_reason = "--no-real" if args.no_real else real_mooncake_reason()
    work = pathlib.Path(tempfile.mkdtemp(prefix="kvplane-bench-engines-"))
    results: dict[str, list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        drivers = start_drivers(engines, real_reason, work, stack)
        for engine in engines:
            results[engine] = run_engine(engine, args, drivers[engine], real_reason, work)
            report(engine, results[engine], args)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"args": vars(args), "results": results},
                                                     indent=1))
    good = all(r.get("skipped") or (r["ok"] and r["bit_exact"])
               for rows in results.values() for r in rows)
    if good:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"\nsome side failed a store or a bit-exact load; logs kept in {work}")
    return 0 if good else 1


def start_drivers(engines: list[str], real_reason: str | None, work: pathlib.Path,
                  stack: contextlib.ExitStack) -> dict[str, dict[str, EngineDriver]]:
    """One driver per (engine, mooncake package), all importing at once (imports dominate)."""
    out: dict[str, dict[str, EngineDriver]] = {}
    for engine in engines:
        kinds = ["kvplane"] + ([] if real_reason else ["real"])
        out[engine] = {k: stack.enter_context(EngineDriver(
            engine, work / f"{engine}-{k}.log", mooncake=k, ready_timeout=None))  # type: ignore[arg-type]
            for k in kinds}
    for by_kind in out.values():
        for driver in by_kind.values():
            driver.ready(600)
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
