"""Smoke-run benchmarks/store.py with tiny sizes (kvplane both ways, and Redis when installed)."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_store_benchmark_smoke(tmp_path):
    # the HA side needs etcd and the Redis column redis-server: each runs where it is installed
    # (always under CI, which installs both); the other sides run everywhere
    ha_side = bool(shutil.which("etcd")) or bool(os.environ.get("CI"))
    sides = "kvplane-tcp,kvplane-shm" + (",kvplane-tcp-ha" if ha_side else "") + (
        ",redis" if shutil.which("redis-server") else "")
    plot = tmp_path / "s.png"
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/store.py"), "--sizes", "4KiB,64KiB", "--batch", "4,6",
         "--duration", "0.05", "--clients", "1", "--sides", sides, "--segment-mb", "64",
         "--cap-mb", "8", "--json", "--plot", str(plot)],
        capture_output=True, text=True, timeout=230)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in out.stdout.splitlines()]
    cells = [r for r in rows if not r.get("ratio")]
    assert {r["impl"] for r in cells} == set(sides.split(",")) | {"memcpy", "floor"}
    assert all(r["verified"] and r["ops_s"] > 0 for r in cells)
    stores = [r for r in cells if r["impl"] not in ("memcpy", "floor")]
    assert {(r["op"], r["batch"]) for r in stores} == {(op, k) for op in ("put", "get") for k in (1, 4, 6)}
    floors = {(r["size"], r["batch"]) for r in cells if r["impl"] == "floor"}
    assert floors == {(s, k) for s in (4096, 65536) for k in (1, 4, 6)}  # one raw round trip each
    remote_get = [r for r in rows if r.get("ratio") and r["topology"] == "remote" and r["op"] == "get"
                  and r["clients"] == 1]
    assert remote_get and all(r["vs_floor"] > 0 for r in remote_get)
    assert {r["topology"] for r in stores} == {"remote", "local"}
    local_get = [r for r in rows if r.get("ratio") and r["topology"] == "local" and r["op"] == "get"
                 and r["batch"] == 1]
    assert local_get and all(r["vs_memcpy"] > 0 for r in local_get)
    assert plot.stat().st_size > 1000
    if ha_side:
        ha = [r for r in rows if r.get("ratio") and r["side"] == "kvplane-tcp-ha"]
        assert ha and all(r["vs_non_ha"] > 0 for r in ha)  # HA over the same side without it


@pytest.mark.requires("nixl")
def test_store_benchmark_nixl_side_smoke():
    """kvplane-nixl: clients and the pool's segment process over NIXL/UCX, bytes verified."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/store.py"), "--sizes", "64KiB", "--batch", "1",
         "--duration", "0.05", "--clients", "1", "--sides", "kvplane-nixl", "--topologies",
         "remote", "--segment-mb", "32", "--cap-mb", "8", "--json"],
        capture_output=True, text=True, timeout=230)
    assert out.returncode == 0, out.stderr[-3000:]
    cells = [json.loads(x) for x in out.stdout.splitlines()]
    nixl = [r for r in cells if not r.get("ratio") and r["impl"] == "kvplane-nixl"]
    assert {r["op"] for r in nixl} == {"put", "get"}
    assert all(r["verified"] and r["ops_s"] > 0 for r in nixl)
