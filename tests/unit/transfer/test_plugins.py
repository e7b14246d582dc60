"""TransportSet and Router.pick: capabilities found once per transport, choices by capability
and preference order, never by name (no sockets: stand-in transports)."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from kvplane.common.errors import InvalidArgument, Unavailable
from kvplane.transfer.engine_route import Router
from kvplane.transfer.memory import MemoryTable
from kvplane.transfer.plugins import TransportSet, load
from kvplane.transfer.seam import Capabilities, Route, Transport, TransportContext
from kvplane.transfer.types import RegionDesc, SegmentDesc

CTX = TransportContext("host", "", 1 << 20, 1, "")
ROUTE = Route(SegmentDesc("peer", "127.0.0.1", 1, "host", 1, [], []), RegionDesc(0, 4096), False)


class _Plain(Transport):
    name = "plain"
    capabilities = Capabilities(priority=1)
    reach = True

    def can_reach(self, route: Route) -> bool:
        return self.reach

    def run(self, route, slices, deadline) -> None:  # pragma: no cover - never run here
        raise AssertionError("not run in these tests")


class _Control(_Plain):
    name = "control"
    capabilities = Capabilities(priority=1, via_listener=True)

    def describe(self, peer, timeout):
        return b""

    def retire(self, peer, gens, timeout):
        return None

    def grant(self, peer, blob, timeout):
        return b""

    def read_scatter(self, jobs, deadline):
        return None

    def write_gather(self, jobs, deadline):
        return None


class _Fast(_Plain):
    name = "fast"
    capabilities = Capabilities(priority=3, same_host_only=True, fallbacks=("none", "control"))

    def read_one(self, peer, view, remote, gen, deadline):
        raise AssertionError

    def write_one(self, peer, view, remote, gen, deadline):
        raise AssertionError


class _First(_Plain):
    name = "first"
    capabilities = Capabilities(priority=0, any_protocol=True)
    reach = False


def _set(**extra: Transport) -> TransportSet:
    return TransportSet({"control": _Control(CTX), "fast": _Fast(CTX), "first": _First(CTX),
                         **extra})


def test_capabilities_are_found_by_method_presence():
    ts = _set(plain=_Plain(CTX))
    assert set(ts.vectored) == {"control"} and set(ts.one_item) == {"fast"}
    assert ts.control is ts.by_name["control"] and ts.prunable == []
    assert [t.name for t in ts.ranked] == ["fast", "control", "plain", "first"]  # ties: load order
    assert [t.name for t in ts.first] == ["first"]


def test_an_engine_without_a_control_channel_is_refused():
    with pytest.raises(InvalidArgument, match="control channel"):
        TransportSet({"plain": _Plain(CTX)})


def test_fallback_follows_the_transports_own_order():
    ts = _set()
    assert ts.fallback(ts.by_name["fast"], ROUTE) is ts.by_name["control"]  # "none" not loaded
    ts.by_name["control"].reach = False
    assert ts.fallback(ts.by_name["fast"], ROUTE) is None
    assert ts.fallback(ts.by_name["control"], ROUTE) is None  # it declares none


def test_pick_goes_by_capability_and_preference():
    ts = _set()
    with cf.ThreadPoolExecutor(1) as ex:
        router = Router(ts, MemoryTable(), lambda h: None, "auto", 1 << 20, ex)
        assert router.pick(None, ROUTE) is ts.by_name["fast"]  # highest priority that reaches
        assert router.pick("control", ROUTE) is ts.by_name["control"]
        ts.by_name["first"].reach = True
        assert router.pick("control", ROUTE) is ts.by_name["first"]  # any_protocol comes first
        ts.by_name["first"].reach = False
        with pytest.raises(InvalidArgument):
            router.pick("missing", ROUTE)
        for t in ts.by_name.values():
            t.reach = False
        with pytest.raises(Unavailable):
            router.pick(None, ROUTE)


def test_load_rejects_what_is_not_a_transport():
    assert load("kvplane.transfer.transports.loopback:LoopbackTransport").name == "loopback"
    with pytest.raises(InvalidArgument, match="not a Transport"):
        load("kvplane.transfer.jobs:Peer")
