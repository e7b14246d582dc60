"""The store over the nixl transport: a real master, a segment and a client in separate
processes, values checksummed, the bytes carried by NIXL (the client's slice counter says so),
every process exiting 0; and ``protocol="rdma"`` served by NIXL, said in the ready line."""

from __future__ import annotations

import pytest

from tests.support.store_procs import spawn_master, spawn_segment, spawn_worker

pytestmark = [pytest.mark.integration, pytest.mark.requires("nixl"), pytest.mark.timeout(120)]


def _ask(w, **cmd):
    import json
    return w.ask(json.dumps(cmd), timeout=60)["result"]


@pytest.mark.parametrize("protocol", ["nixl", "rdma"])
def test_put_get_over_nixl_checksummed(monkeypatch, protocol):
    monkeypatch.setenv("KVPLANE_NIXL", "on")
    # the segment's shm would win on one host: the client loads no shm, so NIXL carries it
    with spawn_master() as m:
        addr = m.info["master"]
        with spawn_segment(addr, "64MiB", "--protocol", protocol) as seg:
            assert seg.info["fabric"]["protocol"] == "nixl", seg.info
            assert "nixl" in seg.info["fabric"]["transports"]
            monkeypatch.setenv("KVPLANE_TRANSPORTS", "tcp,nixl")
            with spawn_worker(addr, "--protocol", protocol, "--checksum") as w:
                assert _ask(w, op="fabric")["protocol"] == "nixl"
                keys = [f"k{i}" for i in range(24)]
                assert _ask(w, op="put", keys=keys[:8], size=4096) == [0] * 8
                assert _ask(w, op="put", keys=keys[8:16], size=1 << 20) == [0] * 8
                assert _ask(w, op="put", keys=keys[16:], size=3 << 20) == [0] * 8
                sizes = {k: 4096 for k in keys[:8]} | {k: 1 << 20 for k in keys[8:16]} | {
                    k: 3 << 20 for k in keys[16:]}
                got = _ask(w, op="check", keys=sizes)
                assert got == {k: "ok" for k in keys}, got
                slices = _ask(w, op="slices")
                assert slices.get("nixl", 0) >= 48, slices  # puts and gets went over NIXL
                w.stop()
                assert w.popen.returncode == 0
            seg.stop()
            assert seg.popen.returncode == 0


def test_rdma_without_nixl_says_tcp(monkeypatch):
    monkeypatch.setenv("KVPLANE_NIXL", "off")
    with spawn_master() as m, spawn_segment(m.info["master"], "16MiB", "--protocol", "rdma") as seg:
        fabric = seg.info["fabric"]
        assert fabric["protocol"] == "tcp" and "nixl" not in fabric["transports"]
        assert "served by TCP" in fabric["reason"]
