"""Speculative gets (``store/client/get_path.py``): a key whose replica the client knows is
read while the master looks it up, and its bytes count only if the master's answer names that
very allocation. Master and segments are processes; the clients read over TCP. Every value is
distinct per key and per write, so a stale or misplaced read shows up as wrong bytes."""

from __future__ import annotations

import contextlib
import signal
import time

import numpy as np
import pytest

from kvplane.common.deadline import Deadline
from kvplane.store.client import replica_io
from kvplane.store.client.client import StoreClient
from kvplane.store.client.get_path import SPECULATED
from kvplane.store.client.lookup import lookup
from kvplane.store.client.read_through import get_replicas
from kvplane.store.errors import InvalidParams, ObjectNotFound
from kvplane.store.types import ReplicateConfig
from tests.support.store_client_proc import round_value
from tests.support.store_procs import segment_pool, spawn_master, spawn_segment

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
SIZE = 4096


def count(outcome: str) -> float:
    return SPECULATED.labels(outcome)._value.get()


def value(key: str, round_: int) -> np.ndarray:
    return round_value(key, round_, SIZE)


@pytest.fixture(scope="module")
def pool():
    with segment_pool() as got:
        yield got


class Side:
    """A client with one registered buffer for puts and one for gets."""

    def __init__(self, master: str, n: int, **cfg) -> None:
        cfg.setdefault("held_reads", False)  # speculation here; held reads: test_held_reads.py
        self.c = StoreClient(master=master, protocol="tcp", **cfg)
        self.tx = np.zeros(SIZE * n, np.uint8)
        self.rx = np.zeros(SIZE * n, np.uint8)
        self.t, self.r = self.c.register_buffer(self.tx), self.c.register_buffer(self.rx)

    def put(self, keys: list[str], round_: int, upsert: bool = False, replicas: int = 1,
            prefer: str = "") -> None:
        for j, k in enumerate(keys):
            self.tx[j * SIZE:(j + 1) * SIZE] = value(k, round_)
        got = self.c.batch_put_from(keys, [self.t + j * SIZE for j in range(len(keys))],
                                    [SIZE] * len(keys), ReplicateConfig(replica_num=replicas,
                                                                    preferred_segment=prefer),
                                    upsert=upsert)
        assert got == [None] * len(keys)

    def get(self, keys: list[str]) -> list:
        self.rx[:] = 0
        return self.c.batch_get_into(keys, [self.r + j * SIZE for j in range(len(keys))],
                                     [SIZE] * len(keys))

    def wrong(self, keys: list[str], round_: int) -> int:
        """Keys read as a success whose bytes are not ``round_``'s value."""
        got = self.get(keys)
        return sum(1 for j, (k, n) in enumerate(zip(keys, got)) if n == SIZE and not
                   np.array_equal(self.rx[j * SIZE:(j + 1) * SIZE], value(k, round_)))

    def close(self) -> None:
        self.c.close()


def test_a_known_key_is_read_while_the_master_looks_it_up(pool):
    addr, _ = pool
    a = Side(addr, 32)
    off = Side(addr, 32, location_cache=0)
    try:
        keys = [f"spec-a-{i}" for i in range(32)]
        a.put(keys, 1)
        # the put taught the client where each key is: exactly what a lookup answers
        results, _ = get_replicas(a.c.context, keys, Deadline.after(5))
        for k, r in zip(keys, results):
            rep = r.replicas[0]
            assert a.c.locations.get(k) == (rep.segment, rep.addr, rep.gen, SIZE)
        before = count("confirmed"), count("refuted")
        assert a.wrong(keys, 1) == 0 and a.get(keys) == [SIZE] * 32
        assert count("confirmed") - before[0] == 64 and count("refuted") == before[1]
        # a single get too, and a client that has never seen the keys learns them on its get
        assert a.c.get_into(keys[0], a.r, SIZE) == SIZE
        assert count("confirmed") - before[0] == 65
        b = Side(addr, 32)
        try:
            assert b.wrong(keys, 1) == 0 and count("confirmed") - before[0] == 65
            assert b.wrong(keys, 1) == 0 and count("confirmed") - before[0] == 97
        finally:
            b.close()
        # turned off: no speculation, the same bytes
        assert off.wrong(keys, 1) == 0 and off.wrong(keys, 1) == 0
        assert count("confirmed") - before[0] == 97 and len(off.c.locations) == 0
    finally:
        a.close()
        off.close()


@contextlib.contextmanager
def two_sides(addr: str, n: int):
    """A reader and another client, both closed after."""
    a, b = Side(addr, n), Side(addr, n)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_a_replaced_object_is_never_read_from_its_old_place(pool):
    # another client upserts every key (new allocations, while the old ones still hold the old
    # bytes): the stale reads are refuted and each key comes back with its new bytes
    with two_sides(pool[0], 32) as (a, b):
        keys = [f"spec-r-{i}" for i in range(32)]
        a.put(keys, 1)
        assert a.wrong(keys, 1) == 0
        for round_ in range(2, 6):
            b.put(keys, round_, upsert=True)
            before = count("refuted")
            assert a.wrong(keys, round_) == 0, f"round {round_}: old bytes returned"
            assert count("refuted") - before == 32  # every old place was read, none accepted
            assert a.get(keys) == [SIZE] * 32
            before = count("confirmed")
            assert a.wrong(keys, round_) == 0  # relearned: read while the master answers
            assert count("confirmed") - before == 32


def test_the_master_answers_only_the_keys_not_where_the_client_read_them(pool):
    with two_sides(pool[0], 8) as (a, b):
        keys = [f"spec-c-{i}" for i in range(8)]
        a.put(keys, 1)
        locs = [a.c.locations.get(k) for k in keys]
        res, _ = get_replicas(a.c.context, keys, Deadline.after(5), expect=locs)
        assert res == [None] * 8  # all confirmed: no replicas sent back
        b.put(keys[:2], 2, upsert=True)
        res, _ = get_replicas(a.c.context, keys, Deadline.after(5), expect=[None, *locs[1:]])
        assert res[2:] == [None] * 6
        assert res[0].code == 0 and res[0].replicas  # not read: answered in full
        assert res[1].code == 0 and res[1].replicas[0].gen != locs[1][2]  # moved: answered
        # reads that failed at places the master confirmed are read again from a new answer
        real, calls = a.c.engine.read_many, []

        def cut_once(items, timeout):
            calls.append(len(items))
            a.c.engine.read_many = real
            raise ConnectionResetError("cut")

        a.c.engine.read_many = cut_once
        before = count("refuted")
        assert a.wrong(keys[2:], 1) == 0 and calls == [6]
        assert count("refuted") - before == 6 and a.get(keys[2:]) == [SIZE] * 6


def test_a_removed_key_is_a_miss_not_its_old_bytes(pool):
    with two_sides(pool[0], 8) as (a, b):
        keys = [f"spec-m-{i}" for i in range(8)]
        a.put(keys, 1)
        assert a.wrong(keys, 1) == 0
        assert b.c.batch_remove(keys[:4], force=True) == [None] * 4
        got = a.get(keys)
        assert all(isinstance(g, ObjectNotFound) for g in got[:4]) and got[4:] == [SIZE] * 4
        assert all(a.c.locations.get(k) is None for k in keys[:4])  # forgotten: no more reads there
        assert a.wrong(keys[4:], 1) == 0


@contextlib.contextmanager
def pool_with_victim():
    """A master with two segments, the second one to kill or stop: a pool of its own, since a
    segment killed or stopped stays mounted for a while and would get other tests' replicas."""
    with spawn_master() as m:
        addr = m.info["master"]
        with spawn_segment(addr, "64MiB"), spawn_segment(addr, "64MiB") as victim:
            yield addr, victim


def learned_on(a: Side, victim, prefix: str) -> list[str]:
    """16 keys put with two replicas, one on ``victim``; ``a`` is taught the victim's ones."""
    keys = [f"{prefix}-{i}" for i in range(16)]
    vname = victim.info["segment"]
    a.put(keys, 1, replicas=2, prefer=vname)
    res, _ = get_replicas(a.c.context, keys, Deadline.after(5))
    there = {k: rep for k, r in zip(keys, res) for rep in r.replicas if rep.segment == vname}
    assert len(there) == 16 and all(len(r.replicas) == 2 for r in res)
    a.c.locations.learn(list(there), list(there.values()), [SIZE] * 16)
    return keys


def test_a_dead_segment_under_a_known_location_fails_over():
    # two replicas; the client learned one; that segment is killed (kill -9): the speculative
    # read fails, and the get is served from the other replica the master names
    with pool_with_victim() as (addr, victim):
        a = Side(addr, 16)
        try:
            keys = learned_on(a, victim, "spec-k")
            victim.kill()
            before = count("refuted")
            assert a.wrong(keys, 1) == 0
            assert a.get(keys) == [SIZE] * 16
            assert count("refuted") - before >= 16
        finally:
            a.close()


def test_a_stalled_segment_under_known_locations_costs_one_get_not_every_get():
    # two replicas; the client learned the ones on a segment that then stops (SIGSTOP: its
    # connections stay open and answer nothing). The first get's speculative read gives up at
    # half the call's time and the key is read from the other replica; the segment is then
    # suspect, so later gets do not speculate on it. Before, every get waited out the stall.
    with pool_with_victim() as (addr, victim):
        a = Side(addr, 16, timeout=2.0)
        try:
            keys = learned_on(a, victim, "spec-s")
            assert a.wrong(keys[:1], 1) == 0  # the connection to the victim is open
            victim.signal(signal.SIGSTOP)
            try:
                took = []
                got = []
                for k in keys:
                    t0 = time.monotonic()
                    got.append(a.c.get(k))
                    took.append(time.monotonic() - t0)
            finally:
                victim.signal(signal.SIGCONT)
            assert got == [value(k, 1).tobytes() for k in keys], "a get failed or read wrong bytes"
            # half of the first call's 2 s is left to read the other replica
            assert took[0] < 1.6, f"the first get took {took[0]:.2f} s of its 2 s"
            assert sum(took[1:]) < 4.0, f"the other gets took {sum(took[1:]):.1f} s: the stall " \
                "was paid again"
        finally:
            a.close()


def test_the_copying_get_speculates_too_and_reads_a_grown_object_at_its_new_size(pool):
    with two_sides(pool[0], 8) as (a, b):
        keys = [f"spec-g-{i}" for i in range(8)]
        a.put(keys, 1)
        before = count("confirmed")
        assert a.c.get_batch(keys) == [value(k, 1).tobytes() for k in keys]
        assert count("confirmed") - before == 8
        # another client replaces every key; one of them with a value twice the size
        b.put(keys[1:], 2, upsert=True)
        big = np.concatenate([value(keys[0], 2), value(keys[0], 3)]).tobytes()
        b.c.upsert(keys[0], big)
        before = count("refuted")
        want = [big] + [value(k, 2).tobytes() for k in keys[1:]]
        assert a.c.get_batch(keys) == want, "old or cut bytes returned"
        assert count("refuted") - before == 8
        before = count("confirmed")
        assert a.c.get_batch(keys) == want and count("confirmed") - before == 8
        # a client that only ever used the copying get learned the places on its first one
        c = Side(pool[0], 1)
        try:
            assert c.c.get_batch(keys) == want and len(c.c.locations) == 8
            before = count("confirmed")
            assert c.c.get_batch(keys) == want and count("confirmed") - before == 8
            assert c.c.get_batch([]) == []
        finally:
            c.close()


def test_a_first_get_takes_the_masters_answer_in_columns(pool, monkeypatch):
    # a client that does not know the keys (cache off) asks for the answer as lists of ints;
    # keys on two segments, then a miss in the batch (a full answer), then a small buffer
    addr, segs = pool
    names = [s.info["segment"] for s in segs]
    with two_sides(addr, 32) as (a, b):
        keys = [f"cols-{i}" for i in range(32)]
        a.put(keys[:16], 1, prefer=names[0])
        a.put(keys[16:], 1, prefer=names[1])
        off = Side(addr, 32, location_cache=0)
        try:
            rep, _ = lookup(off.c.context, keys, Deadline.after(5), columns=True)
            assert rep.results == [] and sorted(rep.columns.segments) == sorted(names)
            fast = []
            real = replica_io.read_columns
            monkeypatch.setattr(replica_io, "read_columns",
                                lambda *a, **k: fast.append(real(*a, **k)) or fast[-1])
            assert off.wrong(keys, 1) == 0  # segments not open yet: read key by key
            assert off.wrong(keys, 1) == 0 and off.get(keys) == [SIZE] * 32
            assert fast[0] is None and fast[1:] == [[SIZE] * 32] * 2  # then in one pass
            assert off.c.get_batch(keys) == [value(k, 1).tobytes() for k in keys]  # copying
            assert fast[3:] == [[SIZE] * 32]
            rep, _ = lookup(off.c.context, [*keys, "cols-none"], Deadline.after(5), columns=True)
            assert rep.columns is None and len(rep.results) == 33
            got = off.get([*keys[:31], "cols-none"])
            assert got[:31] == [SIZE] * 31 and isinstance(got[31], ObjectNotFound)
            got = off.c.batch_get_into(keys[:2], [off.r, off.r + SIZE], [SIZE, SIZE - 1])
            assert got[0] == SIZE and isinstance(got[1], InvalidParams)
            # a client with the cache learns the places from such an answer
            assert b.wrong(keys, 1) == 0  # (opens the segments)
            b.c.locations.clear()
            n = len(fast)
            assert b.wrong(keys, 1) == 0 and fast[n:] == [[SIZE] * 32]
            assert len(b.c.locations) == 32
            before = count("confirmed")
            assert b.wrong(keys, 1) == 0 and count("confirmed") - before == 32
        finally:
            off.close()
