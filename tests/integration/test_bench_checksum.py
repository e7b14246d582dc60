"""Smoke-run the checksum and store A/B benchmarks with tiny sizes: each reports sane numbers."""

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_checksum_benchmark_smoke():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/checksum.py"), "--sizes", "4096",
                          "--seconds", "0.03", "--json"], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in out.stdout.splitlines()]
    assert {r["candidate"] for r in rows} >= {"xxh3-64", "zlib.crc32", "memcpy (scale)"}
    assert all(r["gb_s"] > 0 for r in rows)
    assert [r["vs_xxh3"] for r in rows if r["candidate"] == "xxh3-64"] == [1.0]


@pytest.mark.timeout(120)
def test_store_checksum_benchmark_smoke():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/store_checksum.py"), "--sizes",
                          "4096", "--rounds", "2", "--slice", "0.02", "--json"],
                         capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in out.stdout.splitlines()]
    assert [r["protocol"] for r in rows] == ["tcp", "auto"]
    assert all(r["off_p50_us"] > 0 and r["on_p50_us"] > 0 and r["gets_on"] > 0 for r in rows)


@pytest.mark.timeout(120)
def test_store_ab_benchmark_smoke():
    src = str(ROOT / "src")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/store_ab.py"), "--before", src,
                          "--after", src, "--cells", "get:4096:tcp", "--rounds", "2", "--slice",
                          "0.02", "--json"], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = [json.loads(x) for x in out.stdout.splitlines()]
    assert row["before_p50_us"] > 0 and row["after_p50_us"] > 0 and min(row["calls"]) > 0
