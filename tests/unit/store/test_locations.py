"""The client's location cache (``store/client/locations.py``): bounded, and a read counts only
when the master names the very allocation it came from."""

from __future__ import annotations

import pytest

from kvplane.store.client.location_cache import Locations, confirmed
from kvplane.store.types import Replica

pytestmark = pytest.mark.timeout(10)


def rep(seg: str = "s1", addr: int = 4096, gen: int = 7) -> Replica:
    return Replica(seg, addr, 100, "h:1", "host", gen)


def test_the_oldest_entries_go_first_and_the_bound_holds():
    locs = Locations(3)
    locs.learn([f"k{i}" for i in range(5)], [rep(addr=i) for i in range(5)], [100] * 5)
    assert len(locs) == 3 and locs.get("k0") is None and locs.get("k1") is None
    assert locs.get("k4") == ("s1", 4, 7, 100)
    locs.forget(["k3", "nope"])
    assert len(locs) == 2 and locs.get("k3") is None
    locs.clear()
    assert len(locs) == 0


@pytest.mark.parametrize("other, ok", [
    (rep(), True),
    (rep(gen=8), False),          # the same place, reused by another allocation
    (rep(addr=8192), False),      # moved
    (rep(seg="s2"), False),       # another segment
])
def test_only_the_same_segment_address_and_generation_confirm_a_read(other, ok):
    loc = ("s1", 4096, 7, 100)
    assert confirmed(loc, [other], 100) is ok
    assert confirmed(loc, [rep(seg="s9"), other], 100) is ok  # any of the replicas
    assert not confirmed(loc, [rep()], 101)  # another size: another object
    assert not confirmed(loc, [], 100)  # a miss


def test_holds_follow_the_place_they_were_granted_for():
    """A hold is the read lease of the place a lookup named: a newer place (this client's own
    put meanwhile) is not held by an older lookup, and a put, a forget or the bound drop it."""
    locs = Locations(3)
    far = 1e18  # a lease end far in the future (monotonic seconds)

    def at(addr):
        return ("s1", addr, 7, 100)

    locs.learn(["a", "b"], [rep(addr=1), rep(addr=2)], [100, 100], until=far)
    assert locs.held_until(["a", "b"], [at(1), at(2)], 1.0) == far
    assert locs.held_until(["a"], [at(9)], 1.0) is None  # held, but for another place
    locs.learn(["b"], [rep(addr=3)], [100])  # this client's own put: a new place, no lease
    assert locs.held_until(["b"], [at(3)], 1.0) is None
    locs.hold(["a", "b"], [at(1), at(2)], far)  # a late lookup confirmed the old place of b
    assert locs.held_until(["a"], [at(1)], 1.0) == far
    assert locs.held_until(["b"], [at(3)], 1.0) is None and locs.held("b") is None
    assert locs.held_until(["a", "b"], [at(1), at(3)], 1.0) is None  # every key must be held
    locs.learn(["c", "d"], [rep(addr=4), rep(addr=5)], [100, 100], until=far)  # "a" goes
    assert locs.get("a") is None and locs.held("a") is None
    locs.forget(["c"])
    assert locs.held("c") is None and locs.held("d") == (at(5), far)
    assert locs.held_until(["d"], [at(5)], 2e18) is None  # not fresh enough
    locs.drop_holds()
    assert locs.held("d") is None and locs.get("d") is not None
