"""Smoke-run ``benchmarks/store_scale.py shards`` tiny: both pools answer every key, the CPU
figures are sane."""

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_shards_benchmark_smoke():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/store_scale.py"), "shards",
                          "--repeats", "1", "--seconds", "0.5", "--keys", "300", "--clients",
                          "1", "--batch", "16", "--ops", "lookup"],
                         capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    assert set(doc["cells"]) == {"one master lookup", "2 shards lookup"}
    for cell in doc["cells"].values():
        assert cell["ops_per_s"] > 0 and cell["errors"] == 0
        assert cell["master_cpu_us_per_op"] > 0 and cell["client_cpu_us_per_op"] > 0
    assert doc["ratio lookup"] > 0
