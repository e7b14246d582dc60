"""Smoke-run benchmarks/transfer.py with tiny sizes: every side runs and reports sane numbers."""

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_transfer_benchmark_smoke(tmp_path):
    plot = tmp_path / "t.png"
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/transfer.py"), "--sizes", "4KiB,1MiB",
         "--batches", "1,4", "--buf-mb", "8", "--duration", "0.05", "--json",
         "--impls", "limits,kvplane-tcp,kvplane-shm", "--plot", str(plot)],
        capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in out.stdout.splitlines()]
    impls = {r.get("impl") for r in rows if "impl" in r}
    assert impls == {"memcpy", "raw-socket", "kvplane-tcp", "kvplane-shm"}
    assert all(r["gb_s"] > 0 for r in rows if "impl" in r)
    ratios = [r for r in rows if r.get("ratio")]
    assert len(ratios) == 8 and all(r["tcp_vs_raw"] > 0 and r["shm_vs_memcpy"] > 0 for r in ratios)
    assert plot.stat().st_size > 1000
