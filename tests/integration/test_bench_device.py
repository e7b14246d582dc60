"""Smoke-run benchmarks/device.py tiny on the stand-in device: staged device transfers over tcp
and shm against the copy alone and the transport alone, bytes checked in every cell."""

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_device_benchmark_smoke():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/device.py"), "--device", "standin",
         "--sizes", "256KiB,1MiB", "--chunk", "256KiB", "--repeat", "1", "--duration", "0.02",
         "--json"], capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in out.stdout.splitlines()]
    assert {(r["protocol"], r["op"], r["size"]) for r in rows} == {
        (p, op, s) for p in ("tcp", "shm") for op in ("write", "read") for s in (256 << 10, 1 << 20)}
    assert all(r["verified"] and r["device"] == "standin:0" for r in rows)
    assert all(r["copy_gb_s"] > 0 and r["host_gb_s"] > 0 and r["staged_gb_s"] > 0 for r in rows)
