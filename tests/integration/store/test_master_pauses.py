"""A pass over many objects never holds the master's lock long (issue 32).

A real master (its RPC port and its timer) holds ``N`` objects; its lock records every hold
(``HoldTimer``: thread CPU time, so a loaded machine does not lengthen it) while a probe process
sends ``exist`` RPCs back to back. Each scenario runs one pass: the unmount of an empty segment
and of one holding half the objects (their sweep), an eviction pass, and the sweep and repair
planning that an unmount leaves. Before issue 32 each walked every object in one hold (about
1.8 s for an unmount and 1.1 s for an eviction pass at 1M objects); the 10M figures are in
docs/benchmarks.md (``benchmarks/store_scale.py pauses``).
"""

from __future__ import annotations

import pytest

from kvplane.bench.store_scale_pauses import run_scenario

N = 50_000  # objects: one hold per pass takes 40-70 ms at this size (steps: under 10)
HOLD_MS = 10.0  # the bound on one hold of the master's lock
# The probe's RPC waits are wall time: on a loaded 2-core CI host they reach seconds whatever
# the holds are (1.4 s seen with 3 ms holds), so they are reported by the benchmark, not asserted.


def _holds(row: dict, *passes: str) -> None:
    for name in passes:
        seen = row[name]
        assert seen["longest_hold_cpu_ms"] <= HOLD_MS, (name, seen)
        assert seen["probe_calls"] > 0, (name, seen)  # the probe was served meanwhile


@pytest.mark.timeout(120)
def test_unmounts_sweep_in_short_holds():
    row = run_scenario("unmount", N, timeout=60)
    _holds(row, "unmount_empty", "unmount_s1")
    assert 0 < row["objects_left"] < N  # the objects of s1 went, those of s0 stayed


@pytest.mark.timeout(120)
def test_an_eviction_pass_runs_in_short_holds():
    row = run_scenario("evict", N, timeout=60)
    _holds(row, "evict")
    assert row["evicted"] >= N * 0.05  # the pass freed past the watermark (8 % of the pool)


@pytest.mark.timeout(120)
def test_repair_planning_runs_in_short_holds():
    row = run_scenario("repair", N, timeout=60)
    _holds(row, "unmount_repair")
    assert row["short"] > N // 2 and row["planned"] >= 4096  # two thirds lost a replica
