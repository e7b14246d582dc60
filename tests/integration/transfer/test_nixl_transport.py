"""The nixl transport between real processes over UCX (TCP and shared memory here; RDMA where
the hardware has it): batches checksummed, every UCX transport set, clean exits.

Both sides run in child processes (tests.support.target / tests.support.initiator), so a
crash of NIXL's libraries at exit would show as an exit code here, not take pytest down.
"""

from __future__ import annotations

import os

import pytest

from tests.support.initiator import nixl_env, spawn_initiator
from tests.support.target import spawn_target

pytestmark = [pytest.mark.integration, pytest.mark.requires("nixl"), pytest.mark.timeout(120)]
MB = 1 << 20


@pytest.fixture(params=["", "tcp", "shm,tcp"], ids=["ucx-default", "ucx-tcp", "ucx-shm-tcp"])
def ucx_tls(request):
    return request.param


def test_reads_and_writes_over_nixl_checksummed(ucx_tls):
    env = nixl_env(ucx_tls)
    with spawn_target("--buf-mb", "8", env=env) as tgt, \
            spawn_initiator("--protocol", "nixl", "--base", str(tgt.info["addr"]), env=env) as ini:
        assert "nixl" in ini.info["transports"]
        h = ini.ask(f"open {tgt.info['segment']}")["handle"]
        base = tgt.info["addr"]
        for off, n in [(0, 4096), (12345, MB), (MB, 4 * MB)]:
            r = ini.ask(f"read {h} {base + off} {n}")
            assert r["status"] == ["COMPLETED"], r
            assert r["pattern_ok"], f"wrong bytes over nixl at {off}+{n}"
        r = ini.ask(f"batch {h} {base} 64 4096")
        assert r["status"] == ["COMPLETED"] * 64 and r["pattern_ok"], r
        r = ini.ask(f"write {h} {base + 2 * MB} {MB} 7")
        assert r["status"] == ["COMPLETED"], r
        assert tgt.ask(f"sum {2 * MB} {MB}")["sum"] == 7 * MB
        assert tgt.ask(f"sum {3 * MB} {MB}")["sum"] != 7 * MB  # its neighbour untouched
        ini.stop()
        tgt.stop()
        assert ini.popen.returncode == 0, ini.popen.stderr
        assert tgt.popen.returncode == 0


def test_protocol_nixl_to_a_peer_without_nixl_is_refused():
    with spawn_target("--buf-mb", "1", env={"KVPLANE_NIXL": "off",
                                            "KVPLANE_TRANSPORTS": "tcp,shm,file,local"}) as tgt, \
            spawn_initiator("--protocol", "nixl", env=nixl_env("")) as ini:
        h = ini.ask(f"open {tgt.info['segment']}")["handle"]
        r = ini.ask(f"read {h} {tgt.info['addr']} 4096")
        assert r["status"] == ["FAILED"]
        assert "cannot reach" in r["errors"][0]


def test_environment_is_not_leaking_into_the_suite():
    # the suite pins NIXL off for every engine that does not ask for it (tests/conftest.py)
    assert os.environ.get("KVPLANE_NIXL") == "off"


@pytest.mark.parametrize("ucx_modules", [None, "^efa"], ids=["contained", "user-set"])
def test_an_engine_with_a_nixl_agent_exits_with_0(ucx_modules):
    # an agent that never met a peer: where the host has a system libibverbs, this is the exit
    # that died in libnl-route-3's destructor (rc 139) until nixl.avoid_exit_crash
    env = nixl_env("")
    if ucx_modules is not None:
        env["UCX_MODULES"] = ucx_modules
    ini = spawn_initiator("--protocol", "nixl", env=env)
    assert "nixl" in ini.info["transports"]
    ini.stop()
    assert ini.popen.returncode == 0


def test_prepared_lists_follow_a_peer_whose_advert_changed():
    # a list prepared against the peer's old metadata names keys the reloaded agent no longer
    # has: it must go, and the next read of the same region and block size prepare afresh
    env = nixl_env("")
    with spawn_target("--buf-mb", "4", env=env) as tgt, \
            spawn_initiator("--protocol", "nixl", "--base", str(tgt.info["addr"]), env=env) as ini:
        h = ini.ask(f"open {tgt.info['segment']}")["handle"]
        base = tgt.info["addr"]
        r = ini.ask(f"read {h} {base + 8192} 4096")
        assert r["status"] == ["COMPLETED"] and r["pattern_ok"], r
        before = ini.ask("lists")
        assert [base, 4096] in before["remote"], before  # the read went through a prepared list
        tgt.ask("extra 1")  # a new region: the target's agent metadata (its advert) changes
        assert ini.ask(f"open {tgt.info['segment']}")["handle"] == h  # refreshed descriptor
        r = ini.ask(f"read {h} {base + 8192} 4096")
        assert r["status"] == ["COMPLETED"] and r["pattern_ok"], r
        after = ini.ask("lists")
        assert after["prepared"] == before["prepared"] + 1, (before, after)  # remote re-prepared
        assert after["remote"].count([base, 4096]) == 1
        ini.stop()
        tgt.stop()
        assert ini.popen.returncode == 0, ini.popen.stderr
        assert tgt.popen.returncode == 0


def test_prepared_lists_go_with_an_unregistered_region():
    env = nixl_env("")
    with spawn_target("--buf-mb", "4", env=env) as tgt, \
            spawn_initiator("--protocol", "nixl", "--base", str(tgt.info["addr"]), env=env) as ini:
        h = ini.ask(f"open {tgt.info['segment']}")["handle"]
        base = tgt.info["addr"]
        r = ini.ask(f"batch {h} {base} 8 {64 << 10}")
        assert r["status"] == ["COMPLETED"] * 8 and r["pattern_ok"], r
        lists = ini.ask("lists")
        mine = lists["base"]
        assert [mine, 64 << 10] in lists["local"], lists
        ini.ask("reregister")  # the same buffer, unregistered and registered again
        gone = ini.ask("lists")
        assert not [k for k in gone["local"] if k[0] == mine], gone  # released with its region
        r = ini.ask(f"batch {h} {base} 8 {64 << 10}")
        assert r["status"] == ["COMPLETED"] * 8 and r["pattern_ok"], r
        assert ini.ask("lists")["prepared"] == gone["prepared"] + 1  # prepared on the new one
        ini.stop()
        tgt.stop()
        assert ini.popen.returncode == 0, ini.popen.stderr


def test_an_idle_engine_with_nixl_does_not_spin_a_core():
    # NIXL's Python API starts UCX's progress thread with no poll timeout (a busy loop that
    # takes a whole core for the agent's life); kvplane's agents wait on UCX's event fd
    ini = spawn_initiator("--protocol", "nixl", env=nixl_env(""))
    try:
        cpu = ini.ask("cpu 1")["cpu"]
        assert cpu < 0.3, f"an idle engine used {cpu:.2f} CPU seconds in 1 s"
    finally:
        ini.stop()
    assert ini.popen.returncode == 0
