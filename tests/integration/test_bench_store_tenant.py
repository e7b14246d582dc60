"""Smoke-run benchmarks/store_tenant.py tiny: all three sides measured, the tenant over TCP."""

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_store_tenant_benchmark_smoke():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/store_tenant.py"), "--ops", "20",
                          "--repeat", "2", "--json"], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in out.stdout.splitlines()]
    assert sorted((r["side"], r["op"]) for r in rows) == sorted(
        (s, op) for s in ("service-auto", "service-tcp", "tenant") for op in ("put", "get", "get-hot"))
    by = {(r["side"], r["op"]): r for r in rows}
    assert by[("tenant", "get")]["protocol"] == "tcp"  # a tenant never maps the segment
    assert all(0 < r["p50_us"] < 5e6 for r in rows)
