"""Held reads (``store/client/locations.py``): a get of keys whose places a lookup confirmed less
than half a read lease ago reads them without asking the master. What could change a value
under a running lease (an upsert, a forced remove, a dead or stalled segment) must never make
such a read return the old bytes once that change has returned. Master and segments are
processes; clients read over TCP. Every value is distinct per key and per write, so a stale or
misplaced read shows up as wrong bytes."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvplane.common.errors import Unavailable
from kvplane.store.client.client import StoreClient
from kvplane.store.client.get_path import HELD, SPECULATED
from kvplane.store.errors import ObjectHasLease, ObjectNotFound, TransferFail
from kvplane.store.types import ReplicateConfig
from tests.support.services import wait_until
from tests.support.store_client_proc import round_value
from tests.support.store_procs import segment_pool, spawn_master, spawn_segment

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
SIZE = 4096


def held(outcome: str) -> float:
    return HELD.labels(outcome)._value.get()


def value(key: str, round_: int) -> np.ndarray:
    return round_value(key, round_, SIZE)


@pytest.fixture(scope="module")
def pool():
    with segment_pool() as got:
        yield got


@contextlib.contextmanager
def pool_of_two():
    """A pool for one test (one that kills, stops or blames a segment), segments by name."""
    with segment_pool(2, "32MiB") as (addr, segs):
        yield addr, {s.info["segment"]: s for s in segs}


@contextlib.contextmanager
def sides(addr: str, n: int, reader_protocol: str = "tcp", **cfg) -> Iterator[tuple[Side, Side]]:
    """A writer and a reader (``b``), closed on the way out."""
    a = Side(addr, n, **cfg)
    try:
        b = Side(addr, n, protocol=reader_protocol, **cfg)
        try:
            yield a, b
        finally:
            b.close()
    finally:
        a.close()


class Side:
    """A client (reads over TCP) with a registered buffer for puts and one for gets, counting
    the lookups it sends to the master."""

    def __init__(self, master: str, n: int, **cfg) -> None:
        self.c = StoreClient(master=master, protocol=cfg.pop("protocol", "tcp"), **cfg)
        self.tx = np.zeros(SIZE * n, np.uint8)
        self.rx = np.zeros(SIZE * n, np.uint8)
        self.t, self.r = self.c.register_buffer(self.tx), self.c.register_buffer(self.rx)
        self.lookups = 0
        call = self.c.rpc.call

        def counted(method, *args, **kw):
            if method == "get_replicas":
                self.lookups += 1
            return call(method, *args, **kw)

        self.c.rpc.call = counted  # type: ignore[method-assign]

    def put(self, keys: list[str], round_: int, upsert: bool = False, replicas: int = 1) -> list:
        for j, k in enumerate(keys):
            self.tx[j * SIZE:(j + 1) * SIZE] = value(k, round_)
        return self.c.batch_put_from(keys, [self.t + j * SIZE for j in range(len(keys))],
                                     [SIZE] * len(keys), ReplicateConfig(replica_num=replicas),
                                     upsert=upsert)

    def get(self, keys: list[str]) -> list:
        self.rx[:] = 0
        return self.c.batch_get_into(keys, [self.r + j * SIZE for j in range(len(keys))],
                                     [SIZE] * len(keys))

    def wrong(self, keys: list[str], round_: int) -> tuple[int, list]:
        """(keys read as a success whose bytes are not ``round_``'s value, the results)."""
        got = self.get(keys)
        bad = sum(1 for j, (k, n) in enumerate(zip(keys, got)) if n == SIZE and not
                  np.array_equal(self.rx[j * SIZE:(j + 1) * SIZE], value(k, round_)))
        return bad, got

    def close(self) -> None:
        self.c.close()


def test_a_held_key_is_read_without_asking_the_master(pool):
    addr, _ = pool
    with sides(addr, 32) as (a, b):
        keys = [f"held-plain-{i}" for i in range(32)]
        assert a.put(keys, 1) == [None] * 32
        assert b.wrong(keys, 1) == (0, [SIZE] * 32)  # learned, with the lookup's lease
        assert b.lookups == 1
        before = held("read")
        for _ in range(5):
            assert b.wrong(keys, 1) == (0, [SIZE] * 32)
        assert b.lookups == 1 and held("read") - before == 5 * 32
        assert b.c.get(keys[3]) == value(keys[3], 1).tobytes()  # the copying get too
        assert b.lookups == 1
        # a key it does not hold (a's own put gives no lease) makes the batch ask the master
        assert a.wrong(keys, 1) == (0, [SIZE] * 32) and a.lookups == 1
        # while b holds a lease, a plain remove is refused, as for any reader's lease
        assert a.c.batch_remove(keys[:1])[0].code == ObjectHasLease.code


def test_past_half_the_lease_a_get_asks_the_master_again():
    with spawn_master("--lease-ttl", "1.0") as m, spawn_segment(m.info["master"], "32MiB"):
        with sides(m.info["master"], 4) as (a, b):
            keys = [f"held-refresh-{i}" for i in range(4)]
            assert a.put(keys, 1) == [None] * 4
            assert b.wrong(keys, 1) == (0, [SIZE] * 4) and b.lookups == 1
            assert b.wrong(keys, 1) == (0, [SIZE] * 4) and b.lookups == 1  # held
            # the hold is no longer fresh once half of the 1 s lease has gone
            wait_until(lambda: b.c.locations.held(keys[0])[1] - time.monotonic()
                       <= b.c.lease_ttl / 2, 5, "half of the lease")
            confirmed = SPECULATED.labels("confirmed")._value.get()
            assert b.wrong(keys, 1) == (0, [SIZE] * 4) and b.lookups == 2  # refreshed...
            assert SPECULATED.labels("confirmed")._value.get() - confirmed == 4
            assert b.wrong(keys, 1) == (0, [SIZE] * 4) and b.lookups == 2  # ...and held again


def test_an_upsert_by_another_client_is_never_read_from_the_old_place(pool):
    """Rounds of upserts by a while b holds the keys: after each upsert returns, b's gets
    return the new value, never the old one."""
    addr, _ = pool
    with sides(addr, 32) as (a, b):
        keys = [f"held-upsert-{i}" for i in range(32)]
        assert a.put(keys, 0) == [None] * 32
        assert b.wrong(keys, 0) == (0, [SIZE] * 32)
        wrong, refused = 0, held("refused")
        for rnd in range(1, 9):
            assert b.get(keys) == [SIZE] * 32  # held (or refreshed) right before the upsert
            assert a.put(keys, rnd, upsert=True) == [None] * 32
            bad, got = b.wrong(keys, rnd)
            wrong += bad
            assert got == [SIZE] * 32
        assert wrong == 0
        assert held("refused") - refused == 8 * 32  # every old place was refused, then looked up


def test_a_single_get_into_is_held_and_never_reads_an_upserted_place(pool):
    """``get_into`` of one key has its own held path (``locations.held_one``)."""
    addr, _ = pool
    with sides(addr, 1) as (a, b):
        key = "held-one"
        assert a.put([key], 0) == [None]
        assert b.wrong([key], 0) == (0, [SIZE])  # learned and held (batch path)
        lookups, before = b.lookups, held("read")
        wrong = 0
        for rnd in range(1, 21):
            b.rx[:] = 0
            assert b.c.get_into(key, b.r, SIZE) == SIZE  # held: no lookup
            assert a.put([key], rnd, upsert=True) == [None]
            b.rx[:] = 0
            assert b.c.get_into(key, b.r, SIZE) == SIZE  # refused, looked up, read anew
            wrong += not np.array_equal(b.rx, value(key, rnd))
        assert wrong == 0
        assert b.lookups - lookups == 20  # one per upsert, none for the held gets
        assert held("read") - before >= 20
        with pytest.raises(ObjectNotFound):
            b.c.get_into("held-none", b.r, SIZE)


def test_a_forced_remove_is_a_miss_for_a_client_holding_the_key(pool):
    addr, _ = pool
    with sides(addr, 8) as (a, b):
        keys = [f"held-remove-{i}" for i in range(8)]
        assert a.put(keys, 1) == [None] * 8
        assert b.wrong(keys, 1) == (0, [SIZE] * 8)
        assert b.wrong(keys, 1) == (0, [SIZE] * 8)  # held
        assert a.c.batch_remove(keys, force=True) == [None] * 8
        got = b.get(keys)
        assert [type(g) for g in got] == [ObjectNotFound] * 8


def test_an_upsert_that_cannot_retire_the_old_place_fails_and_the_heartbeat_fence_follows():
    """If the writer cannot reach a segment to retire the old place, that key's upsert fails
    (not committed) and the segment is reported as suspect (hence a pool of its own). The
    master still fences the old generation through the segment owner's heartbeat, so a holder
    stops reading it within a few heartbeats, and meanwhile reads only the value it held."""
    with pool_of_two() as (addr, _):
        unretired(addr)


def unretired(addr: str) -> None:
    with sides(addr, 4) as (a, b):
        keys = [f"held-unretired-{i}" for i in range(4)]
        assert a.put(keys, 1) == [None] * 4
        assert b.wrong(keys, 1) == (0, [SIZE] * 4)

        def unreachable(handle, gens, timeout=5.0):
            raise Unavailable("segment unreachable (test)")

        a.c.engine.retire = unreachable  # type: ignore[method-assign]
        got = a.put(keys, 2, upsert=True)
        assert [type(g) for g in got] == [TransferFail] * 4

        def fenced() -> bool:
            bad, got = b.wrong(keys, 1)  # the held value, or a miss: never other bytes
            assert bad == 0
            assert all(g == SIZE or isinstance(g, ObjectNotFound) for g in got)
            return all(isinstance(g, ObjectNotFound) for g in got)

        wait_until(fenced, 10, "the heartbeat fence at the segment")


def test_same_host_shared_memory_reads_are_not_held(pool):
    """Shared memory has no listener to refuse a retired place: those keys speculate."""
    addr, _ = pool
    with sides(addr, 4, reader_protocol="auto") as (a, b):
        keys = [f"held-shm-{i}" for i in range(4)]
        assert a.put(keys, 1) == [None] * 4
        before = held("read")
        for _ in range(3):
            assert b.wrong(keys, 1) == (0, [SIZE] * 4)
        assert b.lookups == 3 and held("read") == before


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_held_place_on_a_dead_or_stalled_segment_is_read_from_the_other_replica(fault):
    with pool_of_two() as (addr, segs):
        with sides(addr, 16, timeout=2.0) as (a, b):
            victim = None
            try:
                keys = [f"held-{fault}-{i}" for i in range(16)]
                assert a.put(keys, 1, replicas=2) == [None] * 16
                assert b.wrong(keys, 1) == (0, [SIZE] * 16)
                there = b.c.locations.get(keys[0])[0]  # b holds each key at one of its two places
                keys = [k for k in keys if b.c.locations.get(k)[0] == there]
                assert b.wrong(keys, 1) == (0, [SIZE] * len(keys)) and b.lookups == 1  # held
                victim = segs[there]
                if fault == "kill":
                    victim.kill()  # kill -9
                else:
                    victim.signal(signal.SIGSTOP)
                t = time.monotonic()
                assert b.wrong(keys, 1) == (0, [SIZE] * len(keys))
                assert time.monotonic() - t < 1.9  # within the call's 2 s, held read included
            finally:
                if victim is not None and fault == "stop":
                    victim.signal(signal.SIGCONT)
