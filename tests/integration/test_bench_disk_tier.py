"""Smoke-run the SSD tier's benchmark row (benchmarks/store.py --disk-tier) tiny."""

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_disk_tier_benchmark_smoke(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/store.py"), "--disk-tier", "--size", "64KiB",
         "--objects", "4", "--dir", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in out.stdout.splitlines()]
    tiers = {r["tier"]: r for r in rows if r["row"] == "store"}
    assert set(tiers) == {"dram", "ssd-cold", "ssd-warm", "ssd-direct-cold", "recompute"}
    assert all(r["p50_us"] > 0 and r["n"] == 4 for t, r in tiers.items() if t != "recompute")
    assert tiers["recompute"]["measured"] is False and tiers["recompute"]["tokens"] == 4
    assert {r["tier"] for r in rows if r["row"] == "file"} == {
        "cached-cold", "direct-cold", "cached-warm", "direct-warm"}
