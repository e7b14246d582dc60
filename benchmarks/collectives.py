"""Benchmark: kvplane vs gloo allreduce bandwidth, and time to recover from a killed rank.

Runs both backends side by side in one invocation on 127.0.0.1:

* allreduce of float32 tensors (default 1 MiB and 64 MiB) with 2 and 4 ranks: per iteration the
  slowest rank's time, median over iterations. ``kvplane`` is the default (from 1 MiB up the
  allreduce goes through /dev/shm), ``kvplane-ring`` the TCP ring (``shm_bytes=0``) with its
  exact-restart copy, ``kvplane-ring-noexact`` the ring without the copy;
* recovery: 4 ranks allreduce in a loop, the launcher SIGKILLs rank 2; the time from the kill to
  the survivors' next completed op. kvplane completes the op over the survivors; gloo has to
  notice (its own timeout) and rebuild a 3-rank group on a fresh store prefix.

Usage::

    python benchmarks/collectives.py                     # full run (minutes on 2 cores)
    python benchmarks/collectives.py --sizes 4KiB --iters 3 --ranks 2 --recovery-timeout 2

Prints a table and the kvplane/gloo ratios; ``--json PATH`` also writes the raw numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import kvplane.collectives as kc
from kvplane.common.config import parse_size
from tests.support.ranks import RankContext, RankGroup

VICTIM = 2


def _init(ctx: RankContext, backend: str, timeout: float) -> None:
    opts = None
    if backend.startswith("kvplane"):
        opts = kc.KvplaneOptions(timeout=timeout, exact_restart=not backend.endswith("-noexact"),
                                 shm_bytes=0 if "-ring" in backend else None)
        backend = "kvplane"
    dist.init_process_group(backend, store=ctx.store, rank=ctx.rank, world_size=ctx.world_size,
                            timeout=timedelta(seconds=timeout), pg_options=opts)


def _bw_worker(ctx: RankContext, backend: str, nbytes: int, warmup: int, iters: int) -> list[float]:
    _init(ctx, backend, 60.0)
    t = torch.ones(nbytes // 4, dtype=torch.float32)
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    dist.barrier()
    dist.destroy_process_group()
    return times


def _kv_recovery_worker(ctx: RankContext, nbytes: int, timeout: float, after: int) -> dict[str, Any]:
    _init(ctx, "kvplane", timeout)
    t = torch.ones(nbytes // 4, dtype=torch.float32)
    done: list[tuple[float, bool]] = []
    failed_seen = 0
    step = 0
    while failed_seen < after:
        w = dist.all_reduce(t, async_op=True)
        w.wait()
        done.append((time.monotonic(), w.local_success))
        if not w.local_success:
            failed_seen += 1
        step += 1
        ctx.report("step", step)
    return {"done": done}


def _gloo_recovery_worker(ctx: RankContext, nbytes: int, timeout: float, after: int) -> dict[str, Any]:
    _init(ctx, "gloo", timeout)
    pg: Any = dist.group.WORLD
    t = torch.ones(nbytes // 4, dtype=torch.float32)
    done: list[tuple[float, bool]] = []
    rebuilt = False
    step = 0
    ok_after = 0
    while ok_after < after:
        try:
            pg.allreduce([t]).wait()
            done.append((time.monotonic(), not rebuilt))
            if rebuilt:
                ok_after += 1
        except RuntimeError:
            if rebuilt:
                raise
            # rebuild on a fresh prefix: arrival order gives the new rank (torchft-style recipe)
            new_rank = ctx.store.add("rebuild/1", 1) - 1
            prefix = dist.PrefixStore("rebuild/1/", ctx.store)
            # survivors notice the failure up to one timeout apart: the rendezvous must outlast that
            rebuild_timeout = timedelta(seconds=4 * timeout + 10)
            pg = dist.ProcessGroupGloo(prefix, new_rank, ctx.world_size - 1, rebuild_timeout)
            rebuilt = True
        step += 1
        ctx.report("step", step)
    return {"done": done}


def _run_bw(backend: str, ranks: int, nbytes: int, warmup: int, iters: int) -> float:
    with RankGroup(ranks, store_timeout=120.0) as g:
        g.start(_bw_worker, backend, nbytes, warmup, iters)
        res = g.wait_results(list(range(ranks)), 600.0)
    per_iter = [max(res[r][i] for r in range(ranks)) for i in range(iters)]
    return statistics.median(per_iter)


def _run_recovery(backend: str, nbytes: int, timeout: float, after: int) -> float:
    worker = _kv_recovery_worker if backend == "kvplane" else _gloo_recovery_worker
    with RankGroup(4, store_timeout=60.0) as g:
        g.start(worker, nbytes, timeout, after)
        g.wait_event(VICTIM, "step", 60.0)
        for r in (0, 1, 3):
            g.wait_event(r, "step", 60.0)
        killed = time.monotonic()
        g.kill(VICTIM, signal.SIGKILL)
        res = g.wait_results([0, 1, 3], 120.0)
    # recovery = kill -> every survivor has completed an op after the kill
    firsts = [min(ts for ts, _ in res[r]["done"] if ts > killed) for r in (0, 1, 3)]
    return max(firsts) - killed


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1MiB,64MiB", help="comma-separated tensor sizes")
    p.add_argument("--ranks", default="2,4", help="comma-separated world sizes")
    p.add_argument("--iters", type=int, default=0, help="timed iterations (0: 30 below 8 MiB, else 8)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3,
                   help="alternate the backends this many times; report the median of the rounds")
    p.add_argument("--no-exact-column", action="store_true",
                   help="skip the ring's exact_restart=False column")
    p.add_argument("--recovery-size", default="1MiB")
    p.add_argument("--recovery-timeout", type=float, default=5.0, help="op/PG timeout for the kill test")
    p.add_argument("--no-recovery", action="store_true")
    p.add_argument("--json", default="", help="also write raw results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark and print the table; returns the raw results."""
    a = _parse(argv)
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    ranks = [int(r) for r in a.ranks.split(",")]
    out: dict[str, Any] = {"allreduce": [], "recovery": {}, "cpus": os.cpu_count()}
    backends = ["gloo", "kvplane", "kvplane-ring"] + ([] if a.no_exact_column else ["kvplane-ring-noexact"])
    print(f"{'ranks':>5} {'bytes':>10} " + " ".join(f"{b + ' ms':>22}" for b in backends)
          + f" {'kv/gloo':>8} {'ring/gloo':>9}"
          + ("" if a.no_exact_column else f" {'ring-noexact/gloo':>17}"))
    for n in ranks:
        for size in sizes:
            iters = a.iters or (30 if size < (8 << 20) else 8)
            runs: dict[str, list[float]] = {b: [] for b in backends}
            for _ in range(a.rounds):  # interleaved, so load from other users hits all backends
                for b in backends:
                    runs[b].append(_run_bw(b, n, size, a.warmup, iters))
            med = {b: statistics.median(v) for b, v in runs.items()}
            row = {"ranks": n, "bytes": size, "rounds": runs}
            row.update({f"{b.replace('-', '_')}_s": v for b, v in med.items()})
            out["allreduce"].append(row)
            line = f"{n:>5} {size:>10} " + " ".join(f"{med[b] * 1e3:>22.2f}" for b in backends)
            line += f" {med['kvplane'] / med['gloo']:>8.2f} {med['kvplane-ring'] / med['gloo']:>9.2f}"
            if not a.no_exact_column:
                line += f" {med['kvplane-ring-noexact'] / med['gloo']:>17.2f}"
            print(line, flush=True)
    if not a.no_recovery:
        rsize = parse_size(a.recovery_size)
        kv = _run_recovery("kvplane", rsize, a.recovery_timeout, 3)
        gl = _run_recovery("gloo", rsize, a.recovery_timeout, 3)
        out["recovery"] = {"kvplane_s": kv, "gloo_rebuild_s": gl, "timeout_s": a.recovery_timeout,
                           "bytes": rsize}
        print(f"recovery after kill -9 of rank {VICTIM} (4 ranks, {rsize} B, timeout "
              f"{a.recovery_timeout}s): kvplane {kv:.3f}s, gloo rebuild {gl:.3f}s, ratio {kv / gl:.3f}")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
