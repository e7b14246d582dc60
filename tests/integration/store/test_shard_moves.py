"""Slots move between shards under load, shards join and leave, and no acknowledged object is
lost or read wrong (``kvplane.store.shard.mover``; docs/store.md, "Sharded metadata")."""

import hashlib
import threading

import pytest

from kvplane.common.errors import KVPlaneError
from kvplane.store.client.client import StoreClient
from kvplane.store.shard import server as shard_server
from kvplane.store.shard.mover import Mover
from kvplane.store.shard.server import local_pool
from kvplane.store.shard.slots import ShardInfo, owners, slot_of
from tests.support.services import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def value(key: str, n: int = 1500) -> bytes:
    """``n`` bytes that carry their own checksum: a reader can tell wrong bytes."""
    body = (key.encode() * (n // len(key) + 1))[:n - 16]
    return hashlib.blake2b(body, digest_size=16).digest() + body


def intact(got: bytes) -> bool:
    return hashlib.blake2b(got[16:], digest_size=16).digest() == got[:16]


class Load:
    """Writers putting checksummed values and a reader checking what it gets, until stopped."""

    def __init__(self, address: str, writers: int = 2) -> None:
        self.acked: list[str] = []
        self.wrong = 0
        self.failed_puts = 0
        self.reads = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._clients = [StoreClient(master=address, protocol="tcp") for _ in range(writers + 1)]
        self._threads = [threading.Thread(target=self._write, args=(c, i), daemon=True)
                         for i, c in enumerate(self._clients[:-1])]
        self._threads.append(threading.Thread(target=self._read, args=(self._clients[-1],),
                                              daemon=True))

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def _write(self, c: StoreClient, w: int) -> None:
        n = 0
        while not self._stop.is_set():
            keys = [f"load-{w}-{n + i}" for i in range(8)]
            n += 8
            try:
                got = c.put_batch(keys, [value(k) for k in keys])
            except KVPlaneError:
                self.failed_puts += len(keys)
                continue
            with self._lock:
                self.acked += [k for k, e in zip(keys, got) if e is None]
            self.failed_puts += sum(1 for e in got if e is not None)

    def _read(self, c: StoreClient) -> None:
        while not self._stop.is_set():
            with self._lock:
                keys = self.acked[-32:]
            if not keys:
                self._stop.wait(0.01)
                continue
            for k, got in zip(keys, c.get_batch(keys)):
                self.reads += 1
                if isinstance(got, bytes) and (not intact(got) or got != value(k)):
                    self.wrong += 1

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def __exit__(self, *exc: object) -> None:
        self.stop()
        for c in self._clients:
            c.close()


def check_all(address: str, keys: list[str]) -> tuple[int, int]:
    """(lost, wrong) among ``keys``, read back by a fresh client."""
    with StoreClient(master=address, protocol="tcp") as c:
        lost = wrong = 0
        for i in range(0, len(keys), 256):
            part = keys[i:i + 256]
            for k, got in zip(part, c.get_batch(part)):
                if not isinstance(got, bytes):
                    lost += 1
                elif got != value(k):
                    wrong += 1
        return lost, wrong


def test_slots_move_and_shards_come_and_go_under_load_losing_nothing():
    with local_pool(2, admin_port=None) as shards:
        first = shards[0].address
        with StoreClient(master=first, global_segment_size=96 << 20, protocol="tcp"), \
                StoreClient(master=first, global_segment_size=96 << 20, protocol="tcp"), \
                Mover(first, batch=512) as mover, Load(first) as load:
            wait_until(lambda: len(load.acked) > 100, 20, "puts acknowledged before the move")
            own = owners(mover.newest())
            moved = mover.move([s for s in range(len(own)) if own[s] == 0][:3000], 1)
            assert moved.slots == 3000 and moved.objects > 0
            third = shard_server.start(2, shards[0].role.map, admin_port=None)
            try:
                added = mover.add_shard(ShardInfo(2, third.address))
                assert added.objects > 0
                removed = mover.remove_shard(0)
                assert removed.objects > 0 and shards[0].master.state.objects == {}
                after = len(load.acked)  # the load goes on with shard 0 gone
                wait_until(lambda: len(load.acked) > after + 50, 20, "puts after the removal")
                load.stop()
                assert len(load.acked) > 500 and load.reads > 500
                lost, wrong = check_all(third.address, load.acked)
                assert (lost, wrong, load.wrong) == (0, 0, 0), (
                    f"{len(load.acked)} acknowledged, {load.failed_puts} puts failed")
                final = mover.newest()
                assert final.ids() == [1, 2] and not final.moving
                held = [len(s.master.state.objects) for s in (shards[1], third)]
                assert sum(held) == len(load.acked) and min(held) > 0
            finally:
                third.close()


def test_a_move_to_a_shard_that_is_down_is_undone_and_the_source_keeps_serving():
    with local_pool(2, admin_port=None) as shards:
        first = shards[0].address
        with StoreClient(master=first, global_segment_size=32 << 20, protocol="tcp") as host, \
                Mover(first, timeout=0.5, tries=1) as mover:
            keys = [f"undo-{i}" for i in range(200)]
            host.put_batch(keys, [value(k) for k in keys])
            own = owners(mover.newest())
            mine = [k for k in keys if own[slot_of(k)] == 0]
            slots = [s for s in range(len(own)) if own[s] == 0][:200]
            again = next(f"again-{i}" for i in range(100_000)
                         if slot_of(f"again-{i}") in set(slots))
            shards[1].close()  # the target is down
            with pytest.raises(KVPlaneError):
                mover.move(slots, 1)
            after = mover.newest()
            assert not after.moving and owners(after) == own  # the slots went back
            assert host.get_batch(mine) == [value(k) for k in mine]
            host.put(again, value(again))  # writes to those slots are served again
            assert host.get(again) == value(again)
