"""An exists that finds every key tells where they are, under the read lease it takes
(``lookup.exists``): the get that follows reads them without asking the master, and nothing
that changes a value under that lease is ever read from the old place once it has returned."""

from __future__ import annotations

import time
import types

import numpy as np
import pytest

from kvplane.store.client import get_path, lookup
from kvplane.store.errors import ObjectNotFound
from tests.integration.store.test_held_reads import SIZE, sides, value
from tests.support.store_procs import segment_pool

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def pool():
    with segment_pool() as got:
        yield got


def test_a_get_after_exists_reads_without_a_lookup_and_the_right_bytes(pool):
    addr, _ = pool
    with sides(addr, 16) as (a, b):
        keys = [f"ex-plain-{i}" for i in range(16)]
        assert a.put(keys, 1) == [None] * 16
        assert b.wrong(keys, 1)[0] == 0  # opens the segments (a lookup)...
        b.c.locations.forget(keys)  # ...whose places it then forgets
        lookups = b.lookups
        assert b.c.batch_exists(keys) == [True] * 16
        assert b.wrong(keys, 1) == (0, [SIZE] * 16)
        for k in keys[:4]:  # single gets too: the held one-key path
            b.rx[:] = 0
            assert b.c.get_into(k, b.r, SIZE) == SIZE and np.array_equal(b.rx[:SIZE], value(k, 1))
        assert b.lookups == lookups  # no lookup: held from the exists
        # a key that is missing: no places at all (a plain exists), and the gets ask
        assert b.c.batch_exists([keys[0], "ex-none"]) == [True, False]
        assert b.c.locations.held("ex-none") is None


def test_an_upsert_or_forced_remove_after_exists_is_never_read_from_the_old_place(pool):
    addr, _ = pool
    with sides(addr, 8) as (a, b):
        keys = [f"ex-upsert-{i}" for i in range(8)]
        assert a.put(keys, 0) == [None] * 8
        assert b.wrong(keys, 0)[0] == 0
        wrong = 0
        for rnd in range(1, 6):
            assert b.c.batch_exists(keys) == [True] * 8  # held from here
            assert a.put(keys, rnd, upsert=True) == [None] * 8  # retires the old places
            bad, got = b.wrong(keys, rnd)
            wrong += bad
            assert got == [SIZE] * 8
        assert wrong == 0
        assert b.c.batch_exists(keys) == [True] * 8
        assert a.c.batch_remove(keys, force=True) == [None] * 8
        assert [type(g) for g in b.get(keys)] == [ObjectNotFound] * 8


def test_places_from_exists_are_held_only_within_its_lease(pool, monkeypatch):
    """The hold ends when the exist's lease does (counted from before it was sent): past it a
    get asks the master again instead of reading the place it was told."""
    addr, _ = pool
    with sides(addr, 4) as (a, b):
        keys = [f"ex-lease-{i}" for i in range(4)]
        assert a.put(keys, 1) == [None] * 4
        assert b.wrong(keys, 1)[0] == 0  # (the segments opened)
        b.c.locations.forget(keys)
        lease = b.c.lease_ttl
        skew = {"s": 0.0}
        clock = types.SimpleNamespace(monotonic=lambda: time.monotonic() + skew["s"],
                                      time=time.time, sleep=time.sleep)
        for mod in (get_path, lookup):
            monkeypatch.setattr(mod, "time", clock)
        assert b.c.batch_exists(keys) == [True] * 4
        lookups = b.lookups
        assert b.wrong(keys, 1) == (0, [SIZE] * 4) and b.lookups == lookups  # held
        skew["s"] = lease  # the exist's lease is over by this client's clock
        assert b.wrong(keys, 1) == (0, [SIZE] * 4)
        assert b.lookups == lookups + 1  # looked up, not read from the held place
