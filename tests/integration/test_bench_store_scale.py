"""Smoke-run benchmarks/store_scale.py with tiny sizes: ``memory`` (kvplane, and real Mooncake
where an interpreter with it is found), ``pauses``, ``cpu|cold|bytes`` (kvplane's side: Mooncake
runs in the recorded runs, docs/benchmarks.md), and benchmarks/store.py's bytes API with a
working set, and ``table``."""

import json
import pathlib
import shutil
import subprocess
import sys

import pytest

from kvplane.bench.transfer import find_mooncake_python

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(script: str, *args: str) -> list[dict]:
    out = subprocess.run([sys.executable, str(ROOT / script), *args], capture_output=True,
                         text=True, timeout=200, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]


def _scale(*args: str) -> list[dict]:
    return _run("benchmarks/store_scale.py", *args)


def test_memory_smoke():
    sides = "kvplane,mooncake" if find_mooncake_python(None) else "kvplane"
    rows = _scale("memory", "--counts", "3000", "--sides", sides, "--json")
    assert {r["side"] for r in rows} == set(sides.split(","))
    for r in rows:
        assert r["objects"] == 3000 and r["rss_mb"] > r["base_mb"] > 0 and r["fill_s"] >= 0
        assert "load1" in r and "steal_pct" in r
    if "mooncake" in sides:
        assert next(r for r in rows if r["side"] == "kvplane")["rss_vs_mooncake"] > 0


def test_pauses_smoke():
    """One scenario through the command line (tests/integration/store/test_master_pauses.py
    runs every scenario's code at a larger size)."""
    (row,) = _scale("pauses", "--objects", "2000", "--scenarios", "evict")
    assert row["scenario"] == "evict" and row["evicted"] > 0
    assert row["evict"]["longest_hold_cpu_ms"] > 0 and row["evict"]["probe_calls"] > 0


def test_unknown_subcommand_is_refused():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/store_scale.py"), "nope"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "memory" in out.stderr and "cold" in out.stderr


def test_store_scale_cpu_cold_and_bytes_smoke():
    common = ("--sides", "kvplane", "--repeat", "1", "--duration", "0.2", "--segment-mb", "64",
              "--json")
    cpu = _scale("cpu", *common, "--ops", "exists,get,put,bget32", "--clients", "1", "--rate",
                 "0", "--keys", "64")
    assert {r["op"] for r in cpu} == {"exists", "get", "put", "bget32"}
    assert all(r["ops"] > 0 and r["master_cpu_s"] > 0 and r["cpu_per_100k_s"] > 0 for r in cpu)
    floors = ["raw"] + (["raw-c"] if shutil.which("cc") or shutil.which("gcc") else [])
    got = _scale("cold", *common, "--keys", "40", "--segments", "1,2", "--extra-segment-mb",
                 "16", "--sides", ",".join(["kvplane", *floors]))
    cold = [r for r in got if "ratio_of" not in r and r["side"] == "kvplane"]
    assert {(r["op"], r["segments"]) for r in cold} == {
        (op, n) for op in ("cold", "coldx", "put") for n in (1, 2)}
    assert all(r["calls"] > 0 and r["p50_us"] > 0 for r in cold)
    assert [r["calls"] for r in cold if r["op"] != "put"] == [40] * 4  # each key read once
    # the floor: the same cells as bare round trips, and kvplane's share of it per cell
    raw = [r for r in got if "ratio_of" not in r and r["side"] in floors]
    assert {(r["side"], r["op"], r["segments"]) for r in raw} == {
        (f, op, n) for f in floors for op in ("cold", "coldx", "put") for n in (1, 2)}
    assert all(r["calls"] == 40 and r["p50_us"] > 0 for r in raw)
    share = {(r["vs"], r["op"], r["segments"]): r for r in got if "ratio_of" in r}
    assert set(share) == {(f, op, n) for f in floors for op in ("cold", "coldx", "put")
                          for n in (1, 2)}
    for (f, op, n), r in share.items():
        floor = next(x for x in raw if (x["side"], x["op"], x["segments"]) == (f, op, n))
        mine = next(x for x in cold if (x["op"], x["segments"]) == (op, n))
        assert r["ratio"] == pytest.approx(floor["median"] / mine["median"])
    # kvplane with its default same-host protocol copies the segment's shared memory; the
    # kvplane side beside it stays on TCP (as Mooncake's)
    got = _scale("cold", *common, "--keys", "20", "--segments", "1", "--sides",
                 "kvplane,kvplane-shm")
    mapped = {(r["side"], r["op"]): r["shm_mapped"] for r in got if "ratio_of" not in r}
    assert set(mapped) == {(s, op) for s in ("kvplane", "kvplane-shm")
                           for op in ("cold", "coldx", "put")}
    assert all(mapped["kvplane-shm", op] >= 1 and mapped["kvplane", op] == 0
               for op in ("cold", "coldx", "put"))
    got = _scale("bytes", *common, "--size", "256KiB", "--working-set", "4MiB")
    assert {r["op"] for r in got} == {"getb", "getinto"}
    assert all(r["working_set"] == 4 << 20 and r["gb_s"] > 0 for r in got)


def test_store_benchmark_bytes_api_over_a_working_set():
    rows = _run("benchmarks/store.py", "--sizes", "64KiB", "--batch", "4", "--duration", "0.05",
                "--clients", "1", "--sides", "kvplane-tcp", "--topologies", "remote",
                "--segment-mb", "64", "--api", "bytes", "--working-set", "1MiB", "--plot", "",
                "--json")
    cells = [r for r in rows if not r.get("ratio") and r["impl"] == "kvplane-tcp"]
    assert {(r["op"], r["batch"]) for r in cells} == {(op, k) for op in ("put", "get")
                                                      for k in (1, 4)}
    assert all(r["api"] == "bytes" and r["working_set_mb"] == 1 and r["verified"]
               for r in cells)


def test_table_smoke():
    """The per-key microbenchmark of the object table: both paths where the accelerator is
    built (the Python path alone otherwise)."""
    from kvplane.testing.needs import available

    rows = _scale("table", "--objects", "3000", "--calls", "600", "--repeat", "1")
    assert [r["op"] for r in rows] == ["get", "exist", "put"]
    for r in rows:
        assert r["python_us_per_key"] > 0 and "load1" in r and "steal_pct" in r
        if available("store_accel"):
            assert r["native_us_per_key"] > 0 and r["python_over_native"] > 0


def test_placement_smoke(tmp_path):
    """The master's per-put cost against the number of segments; ``--before`` runs another
    tree (here this one, copied) in its own interpreter and checks that it was that tree."""
    import shutil

    before = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "kvplane", before / "kvplane",
                    ignore=shutil.ignore_patterns("__pycache__", "static"))
    rows = _scale("placement", "--segments", "1,16", "--puts", "200", "--repeat", "2",
                  "--before", str(before))
    assert [(r["op"], r["segments"]) for r in rows] == [
        ("spare", 1), ("spare", 16), ("put", 1), ("put", 16), ("preferred", 1), ("preferred", 16)]
    for r in rows:
        assert r["kvplane_us"] > 0 and r["before_us"] > 0 and r["before_over_kvplane"] > 0
        assert "load1" in r and "steal_pct" in r
    assert rows[0]["kvplane_over_fewest"] == 1.0
