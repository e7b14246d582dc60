"""Scheduling simulator benchmark: wall time to replay a trace per policy, against issue 5's target.

Target (issue 5): the full conversation trace (12,031 requests) replays for one policy in < 60 s.
For each policy we time one replay (trace already parsed) and the share spent inside the
conductor's :class:`PrefixIndex` (match / store / remove, timed by a subclass), so the cost of
reading prefixes from the shared index rather than a private copy is visible. One process, one core.

Usage: python benchmarks/scheduling.py [--trace FILE] [--policy mooncake least-loaded] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable
from typing import Any

from kvplane.conductor.indexer import ContextKey, Match, PrefixIndex
from kvplane.conductor.scheduling.config import SimConfig
from kvplane.conductor.scheduling.simulator import Simulator
from kvplane.conductor.scheduling.trace import load_trace
from kvplane.data import SAMPLE_TRACE

DEFAULT_TRACE = SAMPLE_TRACE  # pass --trace conversation_trace.jsonl for the full-length run
TARGET_S = 60.0


class TimedIndex(PrefixIndex):
    """A PrefixIndex that adds up the time spent in its three hot calls."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = {"match": 0.0, "store": 0.0, "remove": 0.0}
        self.calls = {"match": 0, "store": 0, "remove": 0}

    def _tick(self, name: str, start: float) -> None:
        self.seconds[name] += time.perf_counter() - start
        self.calls[name] += 1

    def match(self, ctx: ContextKey, hashes: Iterable[int], instances: Any = None,
              shared: Any = ()) -> dict[str, Match]:
        t = time.perf_counter()
        try:
            return super().match(ctx, hashes, instances, shared)
        finally:
            self._tick("match", t)

    def store(self, ctx: ContextKey, holder: Any, hashes: Iterable[int]) -> int:
        t = time.perf_counter()
        try:
            return super().store(ctx, holder, hashes)
        finally:
            self._tick("store", t)

    def remove(self, ctx: ContextKey, holder: Any, hashes: Iterable[int]) -> int:
        t = time.perf_counter()
        try:
            return super().remove(ctx, holder, hashes)
        finally:
            self._tick("remove", t)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; prints one line per policy and a JSON summary. Returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--policy", nargs="+", default=["mooncake", "least-loaded"])
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    t = time.perf_counter()
    reqs = load_trace(a.trace, limit=a.limit)
    print(f"trace: {len(reqs)} requests parsed in {time.perf_counter() - t:.2f}s (seed {a.seed})")
    rows = []
    for name in a.policy:
        idx = TimedIndex()
        sim = Simulator(SimConfig(seed=a.seed), name, idx)
        t = time.perf_counter()
        sim.run(reqs)
        wall = time.perf_counter() - t
        in_index = sum(idx.seconds.values())
        print(f"{name}: {len(reqs)} requests in {wall:.2f}s = {len(reqs) / wall:,.0f} req/s; "
              f"index {in_index:.2f}s ({100 * in_index / wall:.0f}%: match {idx.calls['match']} calls "
              f"{1e6 * idx.seconds['match'] / max(1, idx.calls['match']):.1f} us each); "
              f"target < {TARGET_S:.0f}s: {'met' if wall < TARGET_S else 'MISSED'}")
        rows.append({"policy": name, "requests": len(reqs), "wall_s": wall, "index_s": in_index,
                     "index_calls": idx.calls, "seed": a.seed})
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
