"""Smoke run of benchmarks/conductor.py with tiny sizes (the real run is documented in docs/conductor.md)."""

import importlib.util
import pathlib
import re

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "conductor.py"


def test_bench_conductor_smoke(capsys):
    spec = importlib.util.spec_from_file_location("bench_conductor", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rc = mod.main(["--blocks", "3000", "--instances", "4", "--prompt-tokens", "512",
                   "--queries", "20", "--http-queries", "5", "--ingest-blocks", "2048",
                   "--walk-calls", "3"])
    out = capsys.readouterr().out
    assert rc == 0
    m = re.search(r"ingest: (\d+) block events in [\d.]+s = ([\d,]+)/s \(gaps 0, indexed (\d+)\)", out)
    assert m and int(m.group(1)) == 2048 and int(m.group(3)) == 2048 and int(m.group(2).replace(",", "")) > 0
    assert re.search(r"memory \(tracemalloc, 3000 blocks\): \d+ B per indexed block", out)
    row = re.search(r"^\s+3000\s+4 \|.*\(cpu\s+[\d.]+\).*\| +[\d.]+ / +[\d.]+ \| [\d.]+, [\d.]+ \| "
                    r"(met|NOT met), (met|NOT met)$", out, re.M)
    assert row, out
    assert re.search(r"^walk    4 instances \| GPU tier only +[\d.]+ / +[\d.]+ \| "
                     r"shared pool on CPU +[\d.]+ / +[\d.]+$", out, re.M), out


def test_bench_conductor_ab_smoke(capsys):
    """benchmarks/conductor_ab.py with this tree on both sides: both answer alike, a row per path."""
    spec = importlib.util.spec_from_file_location("bench_conductor_ab", BENCH.with_name("conductor_ab.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    src = str(BENCH.parents[1] / "src")
    assert mod.main(["--before", src, "--after", src, "--rounds", "2", "--per-turn", "2",
                     "--blocks", "2000", "--instances", "4", "--prompt-tokens", "1024",
                     "--prompts", "2"]) == 0
    out = capsys.readouterr().out
    for path in ("/query_by_hash", "/query"):
        assert re.search(rf"^{path} +p50 before +[\d.]+ ms after +[\d.]+ ms after/before [\d.]+ \|",
                         out, re.M), out
