"""``benchmarks/store_scale.py table``: the per-key cost of the master's object table in one
process, with the store's C accelerator (``native``) and with its Python path (``python``).

Each side is a :class:`~kvplane.store.master.state.MasterState` holding ``--objects`` objects
of 1 KiB (one replica, keys of 32 bytes); the operations are the master's own, without RPC:

* ``get``: ``get_replicas_many`` of ``--batch`` keys drawn at random (a lease and an LRU move
  each), per key;
* ``exist``: ``exist`` of one key drawn at random;
* ``put``: ``put_start`` and ``put_end`` of a new key, then ``remove`` of it (not timed: the
  table keeps its size), per key.

Sides alternate within each repeat (``python`` then ``native``, then the other way round);
each cell is the median over ``--repeat`` repeats of microseconds per key. Imports the
master's state and the bench kit only.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from kvplane.store.master import keys
from kvplane.store.master.state import MasterState
from kvplane.store.types import ReplicateConfig, SegmentInfo

VALUE = 1024
OPS = ("get", "exist", "put")


def _key(i: int) -> str:
    return f"k{i:031d}"


def build(n: int, native: bool) -> MasterState:
    """A state holding ``n`` objects, its table on the C accelerator or on the Python path."""
    saved = getattr(keys, "native", None)  # (the module's switch: tables made now use it)
    if not native:
        setattr(keys, "native", None)  # noqa: B010  # the Python path, for this table only
    elif saved is None:
        raise RuntimeError("the store's C accelerator is not built")
    try:
        st = MasterState()
    finally:
        setattr(keys, "native", saved)  # noqa: B010
    st.mount("c0", [SegmentInfo("s0", 1 << 40, 4 * (n + 1_000_000) * (VALUE + 512), "c0",
                                "127.0.0.1:9", "bench-host")], 0.0)
    cfg = ReplicateConfig()
    for i in range(n):
        key = _key(i)
        r = st.put_start(key, VALUE, cfg, 0.0, checksum=1)
        if r.code or st.put_end(key, 0.0, r.version, 1):
            raise RuntimeError(f"could not fill {key}")
        if len(st.changes) > 4096:
            st.changes.clear()
    st.changes.clear()
    return st


def _get(st: MasterState, keys: list[str], batch: int) -> Callable[[], float]:
    batches = [keys[i:i + batch] for i in range(0, len(keys), batch)]

    def run() -> float:
        t0 = time.perf_counter()
        for b in batches:
            st.get_replicas_many(b, 1.0)
        return time.perf_counter() - t0
    return run


def _exist(st: MasterState, keys: list[str]) -> Callable[[], float]:
    def run() -> float:
        exist = st.exist
        t0 = time.perf_counter()
        for key in keys:
            exist(key, 1.0)
        return time.perf_counter() - t0
    return run


def _put(st: MasterState, keys: list[str]) -> Callable[[], float]:
    cfg = ReplicateConfig()

    def run() -> float:
        t0 = time.perf_counter()
        for key in keys:
            r = st.put_start(key, VALUE, cfg, 2.0, checksum=1)
            st.put_end(key, 2.0, r.version, 1)
        took = time.perf_counter() - t0
        for key in keys:  # (not timed: the table keeps its size)
            st.remove(key, True, 2.0)
        st.changes.clear()
        return took
    return run


def measure(st: MasterState, op: str, n: int, calls: int, batch: int, rng: random.Random
            ) -> float:
    """Microseconds per key of one run of ``op`` over ``calls`` keys."""
    if op == "put":
        base = rng.randrange(1 << 40)
        run = _put(st, [f"new-{base}-{i:020d}" for i in range(calls)])
    else:
        keys = [_key(rng.randrange(n)) for _ in range(calls)]
        run = _get(st, keys, batch) if op == "get" else _exist(st, keys)
    return run() / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    """Command line of ``benchmarks/store_scale.py table``."""
    ap = argparse.ArgumentParser(prog="store_scale.py table",
                                 description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--objects", type=int, default=200_000)
    ap.add_argument("--calls", type=int, default=20_000, help="keys per run of an op")
    ap.add_argument("--batch", type=int, default=32, help="keys per get_replicas_many")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--sides", default="python,native")
    a = ap.parse_args(argv)
    from kvplane.bench.store_scale_memory import cpu_times, host_load

    sides = [s for s in a.sides.split(",") if s]
    if "native" in sides and getattr(keys, "native", None) is None:
        print("the store's C accelerator is not built: python side only", file=sys.stderr)
        sides = [s for s in sides if s != "native"]
    before = cpu_times()
    states = {side: build(a.objects, side == "native") for side in sides}
    rng = random.Random(7)
    seen: dict[tuple[str, str], list[float]] = {}
    for rep in range(a.repeat):
        order = sides if rep % 2 == 0 else sides[::-1]
        for op in a.ops.split(","):
            for side in order:
                us = measure(states[side], op, a.objects, a.calls, a.batch, rng)
                seen.setdefault((op, side), []).append(us)
    load = host_load(before)
    for op in a.ops.split(","):
        row: dict[str, Any] = {"op": op, "objects": a.objects, "repeat": a.repeat}
        for side in sides:
            row[f"{side}_us_per_key"] = round(statistics.median(seen[(op, side)]), 3)
        if len(sides) == 2:
            row["python_over_native"] = round(row["python_us_per_key"] /
                                              row["native_us_per_key"], 2)
        row.update(load)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
