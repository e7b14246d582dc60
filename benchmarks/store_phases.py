"""Where a store get's time goes: the master's lookup and the data read, alone and as a get runs them.

Starts a master and one segment process on 127.0.0.1 and one StoreClient (``--protocol``, tcp
by default) in this process, stores ``--batches`` batches of ``--size``-byte objects, then
measures per batch size (median of ``--calls`` calls each):

* ``rpc``: the master's GetReplicaList for the batch, in a tight loop;
* ``read``: the data part (``replica_io.read``: the READ/READV to the segment and completion) of
  the same replicas, in a tight loop;
* ``get``: the whole ``batch_get_into`` (lookup, then read), and its client CPU time per call;
* ``split``: the lookup and the read run back to back as a get runs them, each timed: against
  the tight loops this shows what waking an idle server process costs.

These are the probes behind docs/benchmarks.md §"On a quiet machine the store is slower than
Mooncake at 4 KiB". Usage:

    python benchmarks/store_phases.py [--size 4096] [--batches 1,32,128] [--calls 1000] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np


def _p50_us(fn, calls: int) -> float:  # type: ignore[no-untyped-def]
    lat = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        lat.append(time.perf_counter() - t)
    return statistics.median(lat) * 1e6


def measure(master: str, protocol: str, size: int, batch: int, calls: int) -> dict[str, float]:
    """The phases of a ``batch``-key get of ``size``-byte objects (p50 microseconds)."""
    from kvplane.common.deadline import Deadline
    from kvplane.store.client import read_through, replica_io
    from kvplane.store.client.client import StoreClient

    with StoreClient(master=master, protocol=protocol) as c:
        src = np.random.default_rng(batch).integers(0, 256, size * batch, dtype=np.uint8)
        dst = np.zeros_like(src)
        s_addr, d_addr = c.register_buffer(src), c.register_buffer(dst)
        keys = [f"phases-{protocol}-{size}-{batch}-{i}" for i in range(batch)]
        addrs = [d_addr + i * size for i in range(batch)]
        sizes = [size] * batch
        failed = [e for e in c.batch_put_from(keys, [s_addr + i * size for i in range(batch)],
                                              sizes) if e is not None]
        if failed:
            raise RuntimeError(f"put failed: {failed[0]!r}")

        def lookup():  # type: ignore[no-untyped-def]
            return read_through.get_replicas(c.context, keys, Deadline.after(c.config.timeout))[0]

        results = lookup()

        def read(res=results):  # type: ignore[no-untyped-def]
            got = replica_io.read(c.context, res, addrs, sizes, Deadline.after(c.config.timeout),
                             time.monotonic() + c.config.timeout)
            if got != sizes:
                raise RuntimeError(f"read failed: {got[:4]}")

        def get():  # type: ignore[no-untyped-def]
            got = c.batch_get_into(keys, addrs, sizes)
            if got != sizes:
                raise RuntimeError(f"get failed: {got[:4]}")

        row = {"protocol": protocol, "size": size, "batch": batch, "calls": calls,
               "rpc_p50_us": _p50_us(lookup, calls), "read_p50_us": _p50_us(read, calls)}
        cpu0, wall0 = time.process_time(), time.perf_counter()
        row["get_p50_us"] = _p50_us(get, calls)
        wall = time.perf_counter() - wall0
        row["get_cpu_share"] = (time.process_time() - cpu0) / wall
        split_rpc, split_read = [], []
        for _ in range(calls):
            t0 = time.perf_counter()
            res = lookup()
            t1 = time.perf_counter()
            read(res)
            split_rpc.append(t1 - t0)
            split_read.append(time.perf_counter() - t1)
        row["split_rpc_p50_us"] = statistics.median(split_rpc) * 1e6
        row["split_read_p50_us"] = statistics.median(split_read) * 1e6
        if not np.array_equal(src, dst):
            raise RuntimeError("the bytes read differ from the bytes stored")
        c.batch_remove(keys, force=True)
        return row


def main(argv: list[str] | None = None) -> int:
    from tests.support.store_procs import spawn_master, spawn_segment

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4096, help="bytes per object")
    ap.add_argument("--batches", default="1,32,128", help="keys per get, comma separated")
    ap.add_argument("--calls", type=int, default=1000, help="calls per measurement")
    ap.add_argument("--protocol", default="tcp", help="tcp or auto (shared memory on one host)")
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    a = ap.parse_args(argv)
    with spawn_master() as m, spawn_segment(m.info["master"], "256MiB"):
        for batch in [int(b) for b in a.batches.split(",")]:
            r = measure(m.info["master"], a.protocol, a.size, batch, a.calls)
            print(json.dumps(r) if a.json else
                  f"{a.protocol} {a.size} B x {batch:>4d}: get {r['get_p50_us']:7.0f} us "
                  f"(client CPU {r['get_cpu_share']:.0%} of wall) | alone: lookup "
                  f"{r['rpc_p50_us']:6.0f} us, read {r['read_p50_us']:6.0f} us | in a get: lookup "
                  f"{r['split_rpc_p50_us']:6.0f} us, read {r['split_read_p50_us']:6.0f} us",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
