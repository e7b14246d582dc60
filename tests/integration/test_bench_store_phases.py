"""Smoke-run benchmarks/store_phases.py tiny: every phase is measured and the bytes check out."""

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_store_phases_benchmark_smoke():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/store_phases.py"), "--batches",
                          "1,4", "--calls", "5", "--json"], capture_output=True, text=True,
                         timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in out.stdout.splitlines()]
    assert [r["batch"] for r in rows] == [1, 4]
    for r in rows:
        assert r["calls"] == 5 and r["size"] == 4096
        for k in ("rpc_p50_us", "read_p50_us", "get_p50_us", "split_rpc_p50_us",
                  "split_read_p50_us"):
            assert 0 < r[k] < 5e6, (k, r)
        assert 0 < r["get_cpu_share"] <= 1.5
