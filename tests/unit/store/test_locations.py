"""The client's location cache (``store/client/locations.py``): bounded, and a read counts only
when the master names the very allocation it came from."""

from __future__ import annotations

import pytest

from kvplane.store.client.locations import Locations, confirmed
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
