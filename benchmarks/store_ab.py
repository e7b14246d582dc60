"""A/B of two kvplane source trees on the store's hot path, alternating, so machine load falls
on both alike: each tree gets its own master, segment and client process, and the two clients
take turns (``--slice`` seconds each, ``--rounds`` rounds, the order flipped every round).
Prints the median latency per call of each tree and after/before.

Usage: python benchmarks/store_ab.py --before /path/to/old/src --after /path/to/new/src
           [--cells get:4096:tcp,put:1048576:auto,bget32:4096:tcp] [--rounds 12] [--slice 0.2]

Ops: ``get`` (get_into), ``put`` (put_from), ``bgetN`` (batch_get_into of N keys, N <= 128),
``bputN`` (batch_put_from of N new keys, N <= 128).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CELLS = ("get:4096:tcp,put:4096:tcp,get:4096:auto,put:4096:auto,"
         "get:1048576:tcp,get:1048576:auto,put:1048576:tcp,put:1048576:auto")


def worker() -> int:
    """One tree's stack and client; stdin lines 'OP SIZE PROTOCOL SECONDS' -> JSON latencies."""
    import numpy as np

    from kvplane.store.client.client import StoreClient

    try:  # the tree measured: kvplane.bench.services since issue 29, the test kit before it
        from kvplane.bench.services import spawn_master, spawn_segment
    except ImportError:
        from kvplane.testing.store_procs import spawn_master, spawn_segment  # type: ignore[no-redef]  # a tree before issue 29

    with spawn_master() as m, spawn_segment(m.info["master"], "256MiB"):
        clients = {p: StoreClient(master=m.info["master"], protocol=p) for p in ("tcp", "auto")}
        state: dict[tuple[str, int], tuple] = {}
        print("ready", flush=True)
        for line in sys.stdin:
            op, size_s, proto, secs = line.split()
            size, c = int(size_s), clients[proto]
            if (proto, size) not in state:
                buf = np.random.default_rng(size).integers(0, 256, size * 128, dtype=np.uint8)
                addr = c.register_buffer(buf)
                # 256 keys, at most 64 MiB of them: 256 of 1 MiB overfill the 256 MiB segment (the
                # master then evicts keys the loop reads: ObjectNotFound)
                keys = [f"{proto}-{size}-{i}" for i in range(max(8, min(256, (64 << 20) // size)))]
                for k in keys:
                    c.put_from(k, addr, size)
                state[(proto, size)] = (buf, addr, keys, {"get": 0, "put": 0})
            _, addr, keys, count = state[(proto, size)]
            lat, end = [], time.monotonic() + float(secs)
            k = int(op[4:]) if op.startswith(("bget", "bput")) else 1  # bgetN/bputN: N keys
            count.setdefault(op, 0)
            while time.monotonic() < end:
                i, t = count[op], time.perf_counter()
                if op.startswith("bput"):
                    batch = [f"bp-{proto}-{size}-{i}-{j}" for j in range(k)]
                    errs = c.batch_put_from(batch, [addr + j * size for j in range(k)], [size] * k)
                    if any(e is not None for e in errs):
                        raise RuntimeError(f"batch put failed: {errs[:3]}")
                    if i >= 2:
                        c.batch_remove([f"bp-{proto}-{size}-{i - 2}-{j}" for j in range(k)],
                                       force=True)
                elif k > 1:
                    batch = [keys[(i * k + j) % len(keys)] for j in range(k)]
                    got = c.batch_get_into(batch, [addr + j * size for j in range(k)], [size] * k)
                    if any(n != size for n in got):
                        raise RuntimeError(f"batch get failed: {got[:3]}")
                elif op == "get":
                    c.get_into(keys[i % len(keys)], addr, size)
                else:
                    c.put_from(f"p-{proto}-{size}-{i}", addr, size)
                    if i >= 64:
                        c.remove(f"p-{proto}-{size}-{i - 64}", force=True)
                lat.append(time.perf_counter() - t)
                count[op] = i + 1
            print(json.dumps(lat), flush=True)
        for c in clients.values():
            c.close()
    return 0


def _start(src: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": src})
    if p.stdout is None or p.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the worker for {src} did not start")
    return p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--before")
    ap.add_argument("--after")
    ap.add_argument("--cells", default=CELLS, help="OP:SIZE:PROTOCOL, comma separated")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--slice", type=float, default=0.2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.worker:
        return worker()
    trees = {"before": _start(a.before), "after": _start(a.after)}
    try:
        for cell in a.cells.split(","):
            op, size, proto = cell.split(":")
            lat: dict[str, list[float]] = {"before": [], "after": []}
            for r in range(a.rounds):
                for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
                    p = trees[name]
                    p.stdin.write(f"{op} {size} {proto} {a.slice}\n")  # type: ignore[union-attr]
                    p.stdin.flush()  # type: ignore[union-attr]
                    lat[name] += json.loads(p.stdout.readline())  # type: ignore[union-attr]
            b, n = (statistics.median(lat[k]) * 1e6 for k in ("before", "after"))
            row = {"op": op, "size": int(size), "protocol": proto, "before_p50_us": b,
                   "after_p50_us": n, "after_vs_before": n / b,
                   "calls": [len(lat["before"]), len(lat["after"])]}
            print(json.dumps(row) if a.json else
                  f"{proto:4s} {op} {int(size):>8d} B  p50 before {b:6.0f} us  after {n:6.0f} us"
                  f"  after/before {n / b:.2f}", flush=True)
    finally:
        for p in trees.values():
            p.stdin.close()  # type: ignore[union-attr]
            p.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
