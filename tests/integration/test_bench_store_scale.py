"""Smoke-run benchmarks/store_scale.py with tiny sizes: ``memory`` (kvplane, and real Mooncake
where an interpreter with it is found) and ``pauses``."""

import json
import pathlib
import subprocess
import sys

import pytest

from kvplane.bench.transfer import find_mooncake_python

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(*args: str) -> list[dict]:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/store_scale.py"), *args],
                         capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(x) for x in out.stdout.splitlines()]


def test_memory_smoke():
    sides = "kvplane,mooncake" if find_mooncake_python(None) else "kvplane"
    rows = _run("memory", "--counts", "3000", "--sides", sides, "--json")
    assert {r["side"] for r in rows} == set(sides.split(","))
    for r in rows:
        assert r["objects"] == 3000 and r["rss_mb"] > r["base_mb"] > 0 and r["fill_s"] >= 0
        assert "load1" in r and "steal_pct" in r
    if "mooncake" in sides:
        assert next(r for r in rows if r["side"] == "kvplane")["rss_vs_mooncake"] > 0


def test_pauses_smoke():
    """One scenario through the command line (tests/integration/store/test_master_pauses.py
    runs every scenario's code at a larger size)."""
    (row,) = _run("pauses", "--objects", "2000", "--scenarios", "evict")
    assert row["scenario"] == "evict" and row["evicted"] > 0
    assert row["evict"]["longest_hold_cpu_ms"] > 0 and row["evict"]["probe_calls"] > 0


def test_unknown_subcommand_is_refused():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/store_scale.py"), "nope"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "memory" in out.stderr


def test_table_smoke():
    """The per-key microbenchmark of the object table: both paths where the accelerator is
    built (the Python path alone otherwise)."""
    from kvplane.testing.needs import available

    rows = _run("table", "--objects", "3000", "--calls", "600", "--repeat", "1")
    assert [r["op"] for r in rows] == ["get", "exist", "put"]
    for r in rows:
        assert r["python_us_per_key"] > 0 and "load1" in r and "steal_pct" in r
        if available("store_accel"):
            assert r["native_us_per_key"] > 0 and r["python_over_native"] > 0
