"""The nixl transport's prepared descriptor lists (``nixl_lists.PreppedLists``) on a fake
agent: cached per side, region and block size; released with their region or their peer's
metadata, never under a request still using them; bounded; and the agent's progress thread
given a poll timeout (``nixl_setup.new_agent``)."""

from __future__ import annotations

import sys
import types

import pytest

from kvplane.transfer.transports import nixl_setup
from kvplane.transfer.transports.nixl_lists import LOCAL, PreppedLists

pytestmark = pytest.mark.timeout(10)


class FakeAgent:
    def __init__(self, refuse: Exception | None = None) -> None:
        self.live: dict[int, tuple] = {}
        self.next = 1
        self.refuse = refuse

    def prep_xfer_dlist(self, agent, rows, mem):
        if self.refuse is not None:
            raise self.refuse
        h = self.next
        self.next += 1
        self.live[h] = (agent, tuple(int(x) for x in rows[0]), mem)
        return h

    def release_dlist_handle(self, h):
        del self.live[h]


def _pair(lists, peer="peer-a", lbase=0x1000, rbase=0x9000, block=4096):
    return lists.acquire_pair((LOCAL, lbase, 1 << 20, block, "DRAM", 0),
                              (peer, rbase, 1 << 20, block, "DRAM", 0))


def test_a_region_and_block_size_is_prepared_once_as_one_compressed_row():
    ag = FakeAgent()
    lists = PreppedLists(ag)
    lp, rp = _pair(lists)
    lists.release((lp, rp))
    again = _pair(lists)
    lists.release(again)
    assert again == (lp, rp) and lists.prepared == 2
    assert ag.live[lp.handle] == (LOCAL, (0x1000, 4096, 0, 4096, 256), "DRAM")
    assert ag.live[rp.handle][0] == "peer-a"
    other = _pair(lists, block=8192)  # another block size: its own lists
    assert other[0] is not lp and lists.prepared == 4


def test_unregistering_a_region_releases_only_its_local_lists():
    ag = FakeAgent()
    lists = PreppedLists(ag)
    a = _pair(lists, lbase=0x1000)
    b = _pair(lists, lbase=0x200000)
    lists.release(a)
    lists.release(b)
    lists.drop_region(0x1000)
    assert a[0].handle not in ag.live  # released
    assert b[0].handle in ag.live and a[1].handle in ag.live
    fresh = _pair(lists, lbase=0x1000)
    assert fresh[0] is not a[0] and fresh[0].handle in ag.live


def test_a_peer_reloaded_loses_the_lists_prepared_against_it():
    ag = FakeAgent()
    lists = PreppedLists(ag)
    a = _pair(lists, peer="peer-a")
    b = _pair(lists, peer="peer-b")
    lists.release(a)
    lists.release(b)
    lists.drop_peer("peer-a")
    assert a[1].handle not in ag.live
    assert b[1].handle in ag.live and a[0].handle in ag.live  # ours and the other peer's stay
    assert _pair(lists, peer="peer-a")[1] is not a[1]


def test_a_list_in_use_is_released_by_its_last_user_not_under_it():
    ag = FakeAgent()
    lists = PreppedLists(ag)
    held = _pair(lists)
    lists.drop_peer("peer-a")
    lists.drop_region(0x1000)
    assert held[0].handle in ag.live and held[1].handle in ag.live  # a request still runs
    assert lists.held() == []  # but no new request gets them
    lists.release(held)
    assert ag.live == {}


def test_lists_are_bounded_least_recently_used_first_out():
    ag = FakeAgent()
    lists = PreppedLists(ag, limit=2)
    first = _pair(lists, lbase=0x1000, rbase=0x1000)
    lists.release(first)
    for base in (0x2000, 0x3000):
        lists.release(_pair(lists, lbase=base, rbase=base))
    assert len(ag.live) == 4 and first[0].handle not in ag.live
    lists.close()
    assert ag.live == {}


@pytest.mark.parametrize("exc, broken", [(TypeError("no Nx5"), True),
                                         (RuntimeError("NIXL_ERR_NOT_FOUND"), False)])
def test_a_list_nixl_refuses_means_no_prepared_request(exc, broken):
    lists = PreppedLists(FakeAgent(refuse=exc))
    assert _pair(lists) is None and lists.held() == []
    assert lists.broken is broken  # an API without compressed lists: never tried again


def _fake_nixl(monkeypatch):
    """A NIXL API module whose nixl_agent builds its config the way nixl_cu12._api does."""
    api = types.ModuleType("fake_nixl_api")
    built = []

    class Config:
        def __init__(self):
            self.pthrDelay, self.useProgThread = 0, False

    class Bind:
        nixlAgentConfig = Config

        @staticmethod
        def nixlAgent(name, cfg):
            built.append((name, cfg.pthrDelay))
            return name

    class Conf:
        def __init__(self, backends):
            self.backends = backends

    class Agent:
        def __init__(self, name, conf):
            c = api.nixlBind.nixlAgentConfig()
            c.useProgThread = True
            c.pthrDelay = 0  # what the real API hard-codes
            self.agent = api.nixlBind.nixlAgent(name, c)

    Agent.__module__ = api.__name__
    api.nixlBind, api.nixl_agent, api.nixl_agent_config = Bind, Agent, Conf
    monkeypatch.setitem(sys.modules, api.__name__, api)
    return api, built


def test_agents_get_a_progress_thread_that_waits(monkeypatch):
    api, built = _fake_nixl(monkeypatch)
    monkeypatch.delenv(nixl_setup.PROGRESS_ENV, raising=False)
    nixl_setup.new_agent(api, "a")
    monkeypatch.setenv(nixl_setup.PROGRESS_ENV, "0")  # NIXL's own busy loop, on request
    nixl_setup.new_agent(api, "b")
    assert built == [("a", nixl_setup.PROGRESS_US), ("b", 0)]
    assert api.nixlBind.__name__ == "Bind"  # the bindings are put back


def test_a_bad_progress_setting_is_refused(monkeypatch):
    monkeypatch.setenv(nixl_setup.PROGRESS_ENV, "soon")
    with pytest.raises(nixl_setup.InvalidArgument, match="microseconds"):
        nixl_setup.progress_delay()
