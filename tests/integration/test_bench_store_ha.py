"""Smoke-run benchmarks/store_ha.py tiny: the oplog comparison and the recovery costs are sane."""

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120), pytest.mark.requires("etcd")]
ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_store_ha_benchmark_smoke():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/store_ha.py"), "--segment-mb",
                          "2", "--sizes", "4096,65536", "--puts", "10", "--json"],
                         capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in out.stdout.splitlines()]
    oplog = [r for r in rows if r["bench"] == "oplog"]
    assert len(oplog) == 1 and oplog[0]["etcd_put_p50_us"] > 0 and oplog[0]["oplog_share"] > 0
    rec = {r["size"]: r for r in rows if r["bench"] == "recovery"}
    assert set(rec) == {4096, 65536}
    assert rec[4096]["records"] > rec[65536]["records"] > 0  # the scan found every record
    assert all(r["scan_s"] > 0 and r["adopt_us_per_record"] > 0 for r in rec.values())
