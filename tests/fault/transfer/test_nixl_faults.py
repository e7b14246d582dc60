"""The nixl transport when things go wrong: a peer killed or stopped mid-transfer ends within
the deadline (never a hang), a range the peer never registered is refused, and a store
generation the owner's fence floor no longer admits is refused before any byte moves.

Both sides are child processes (NIXL's libraries never load into pytest)."""

from __future__ import annotations

import signal

import pytest

from kvplane.transfer.fence import EPOCH_SHIFT
from tests.support.initiator import nixl_env, spawn_initiator
from tests.support.target import spawn_target

pytestmark = [pytest.mark.fault, pytest.mark.requires("nixl"), pytest.mark.timeout(120)]
MB = 1 << 20


def _pair(*target_args: str, ucx_tls: str = "tcp"):
    env = nixl_env(ucx_tls)
    tgt = spawn_target(*target_args, env=env)
    ini = spawn_initiator("--protocol", "nixl", "--buf-mb", "64", "--base",
                          str(tgt.info["addr"]), env=env)
    h = ini.ask(f"open {tgt.info['segment']}")["handle"]
    return tgt, ini, h


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_peer_gone_mid_transfer_ends_within_the_deadline(how):
    tgt, ini, h = _pair("--buf-mb", "64")
    try:
        r = ini.ask(f"read {h} {tgt.info['addr']} {64 * MB} 10")  # warm: the path works
        assert r["status"] == ["COMPLETED"] and r["pattern_ok"]
        if how == "kill":
            tgt.kill()
        else:
            tgt.signal(signal.SIGSTOP)
        # many reads back to back: the first after the loss must end by its 2 s deadline
        r = ini.ask(f"batch {h} {tgt.info['addr']} 16 {4 * MB} 2", timeout=60)
        assert set(r["status"]) <= {"FAILED", "TIMEOUT"}, r
        assert r["secs"] < 2 + 3, f"took {r['secs']:.1f}s against a 2 s deadline"
        assert not r["pattern_ok"] or how == "stop"
        ini.stop()
        assert ini.popen.returncode == 0, "the initiator did not exit cleanly"
    finally:
        ini.stop()
        tgt.stop()  # reaps (and closes the pipes of) a killed or stopped target


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_one_request_to_a_gone_peer_ends_within_the_deadline(how):
    # transfer_one's cached route and route_one: the same deadline as a batch
    tgt, ini, h = _pair("--buf-mb", "64")
    try:
        r = ini.ask(f"oneread {h} {tgt.info['addr']} {4 * MB} 10")  # warm: the route is cached
        assert r["status"] == ["COMPLETED"] and r["pattern_ok"]
        if how == "kill":
            tgt.kill()
        else:
            tgt.signal(signal.SIGSTOP)
        for _ in range(3):
            r = ini.ask(f"oneread {h} {tgt.info['addr']} {64 * MB} 2", timeout=60)
            assert r["status"][0] in ("FAILED", "TIMEOUT"), r
            assert r["secs"] < 2 + 3, f"took {r['secs']:.1f}s against a 2 s deadline"
        ini.stop()
        assert ini.popen.returncode == 0, "the initiator did not exit cleanly"
    finally:
        ini.stop()
        tgt.stop()


def test_unregistered_remote_range_is_refused_not_crashed():
    tgt, ini, h = _pair("--buf-mb", "1")
    try:
        end = tgt.info["addr"] + MB
        r = ini.ask(f"read {h} {end - 100} 4096")  # runs past the registered region
        assert r["status"] == ["FAILED"], r
        r = ini.ask(f"read {h} {tgt.info['addr']} 4096")  # and the peer still serves
        assert r["status"] == ["COMPLETED"] and r["pattern_ok"]
    finally:
        ini.stop()
        tgt.stop()
    assert ini.popen.returncode == 0 and tgt.popen.returncode == 0


def test_stale_generation_is_refused_on_a_fenced_region():
    tgt, ini, h = _pair("--fenced", "--buf-mb", "2")
    try:
        base = tgt.info["addr"]
        assert tgt.ask("epoch 3")["floor"] == 3 << EPOCH_SHIFT
        old, cur = (2 << EPOCH_SHIFT) + 5, (3 << EPOCH_SHIFT) + 5
        before = tgt.ask(f"sum {MB} 4096")["sum"]
        r = ini.ask(f"write {h} {base + MB} 4096 9 5 {old}")
        assert r["status"] == ["FAILED"] and "fenced" in r["errors"][0], r
        assert tgt.ask(f"sum {MB} 4096")["sum"] == before  # not one byte landed
        r = ini.ask(f"write {h} {base + MB} 4096 9 5 {cur}")
        assert r["status"] == ["COMPLETED"], r
        assert tgt.ask(f"sum {MB} 4096")["sum"] == 9 * 4096
        r = ini.ask(f"read {h} {base + MB} 4096 5 {old}")
        assert r["status"] == ["FAILED"], r
    finally:
        ini.stop()
        tgt.stop()
