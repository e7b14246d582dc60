"""Smoke-run benchmarks/transfer.py with tiny sizes: every side runs and reports sane numbers
(the NIXL sides where nixl_cu12 is installed: a worker exits 0, the bytes verified)."""

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


@pytest.mark.requires("nixl")
def test_nixl_sides_smoke():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/transfer.py"), "--sizes", "4KiB,1MiB",
         "--batches", "1,4", "--buf-mb", "8", "--duration", "0.05", "--json", "--plot", "",
         "--impls", "limits,kvplane-nixl,nixl-raw,nixl-raw-shmtcp"],
        capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in out.stdout.splitlines()]
    cells = [r for r in rows if "impl" in r]
    assert {r["impl"] for r in cells} == {"memcpy", "raw-socket", "kvplane-nixl", "nixl-raw",
                                          "nixl-raw-shmtcp"}
    assert all(r["gb_s"] > 0 for r in cells)
    assert {r["ucx_tls"] for r in cells if "nixl" in r["impl"]} == {"default", "shm,tcp"}
    ratios = {(r["ucx_tls"], r["op"], r["size"], r["batch"]): r
              for r in rows if r.get("ratio") and r["side"].startswith("nixl")}
    assert len(ratios) == 16
    assert all(r["kvplane_vs_raw"] > 0 and r["raw_vs_socket"] > 0
               for k, r in ratios.items() if k[0] == "default")
    assert all(r["kvplane_vs_raw"] is None for k, r in ratios.items() if k[0] == "shm,tcp")
