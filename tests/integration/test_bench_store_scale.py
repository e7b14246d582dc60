"""Smoke-run benchmarks/store_scale.py cpu|cold|bytes and benchmarks/store.py's bytes API with
a working set, tiny (kvplane's side: Mooncake runs in the recorded runs, docs/benchmarks.md)."""

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(*args: str) -> list[dict]:
    out = subprocess.run([sys.executable, *args, "--json"], capture_output=True, text=True,
                         timeout=200, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]


def test_store_scale_cpu_cold_and_bytes_smoke():
    common = ("--sides", "kvplane", "--repeat", "1", "--duration", "0.2", "--segment-mb", "64")
    cpu = _run("benchmarks/store_scale.py", "cpu", *common, "--ops", "exists,get,put,bget32",
               "--clients", "1", "--rate", "0", "--keys", "64")
    assert {r["op"] for r in cpu} == {"exists", "get", "put", "bget32"}
    assert all(r["ops"] > 0 and r["master_cpu_s"] > 0 and r["cpu_per_100k_s"] > 0 for r in cpu)
    cold = _run("benchmarks/store_scale.py", "cold", *common, "--keys", "40", "--segments",
                "1,2", "--extra-segment-mb", "16")
    assert {(r["op"], r["segments"]) for r in cold} == {
        (op, n) for op in ("cold", "coldx", "put") for n in (1, 2)}
    assert all(r["calls"] > 0 and r["p50_us"] > 0 for r in cold)
    assert [r["calls"] for r in cold if r["op"] != "put"] == [40] * 4  # each key read once
    got = _run("benchmarks/store_scale.py", "bytes", *common, "--size", "256KiB",
               "--working-set", "4MiB")
    assert {r["op"] for r in got} == {"getb", "getinto"}
    assert all(r["working_set"] == 4 << 20 and r["gb_s"] > 0 for r in got)


def test_store_benchmark_bytes_api_over_a_working_set():
    rows = _run("benchmarks/store.py", "--sizes", "64KiB", "--batch", "4", "--duration", "0.05",
                "--clients", "1", "--sides", "kvplane-tcp", "--topologies", "remote",
                "--segment-mb", "64", "--api", "bytes", "--working-set", "1MiB", "--plot", "")
    cells = [r for r in rows if not r.get("ratio") and r["impl"] == "kvplane-tcp"]
    assert {(r["op"], r["batch"]) for r in cells} == {(op, k) for op in ("put", "get")
                                                      for k in (1, 4)}
    assert all(r["api"] == "bytes" and r["working_set_mb"] == 1 and r["verified"]
               for r in cells)
