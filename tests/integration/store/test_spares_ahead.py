"""Spares placed ahead (``MasterServer._spare``): after answering a PutEnd the master places
the client's next spare but one, and its next PutEnd hands that one out as if placed then.
Master in this process (its table and clock are looked at), clients over real sockets."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest

from kvplane.store.client.client import StoreClient
from kvplane.store.master import spares
from kvplane.store.master.config import MasterConfig
from kvplane.store.master.server import MasterServer
from tests.support.services import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
KB = 1024


class Clock:
    """A master clock the test moves (the clients keep their own)."""

    def __init__(self) -> None:
        import time

        self.t = time.monotonic()
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.t

    def advance(self, s: float) -> None:
        with self._lock:
            self.t += s


def spare_rows(m: MasterServer) -> dict[str, float]:
    """Unwritten spares in the master's table: name -> the end of its write window."""
    with m.lock:
        return {k: m.state.objects[k].window_until for k in list(m.state.objects)
                if k.startswith(spares.PREFIX)}


def value(key: str, n: int) -> bytes:
    return np.random.default_rng(abs(hash(key)) % (1 << 32)).integers(
        0, 256, n, dtype=np.uint8).tobytes()


@contextlib.contextmanager
def pool(clock: Clock | None = None, **cfg: float):
    with MasterServer(MasterConfig(**cfg), admin_port=None,
                      **({"clock": clock} if clock else {})) as m:
        addr = f"127.0.0.1:{m.port}"
        with StoreClient(master=addr, global_segment_size=64 << 20) as seg:
            yield m, addr
            seg.health_check()


def test_each_put_end_hands_out_the_spare_placed_after_the_last_one():
    with pool() as (m, addr), StoreClient(master=addr, protocol="tcp") as w, \
            StoreClient(master=addr, protocol="tcp", checksum=True) as r:
        keys = [f"ahead-{i}" for i in range(40)]
        handed: list[str] = []
        for k in keys:
            with m.lock:
                before = dict(m._ahead)
            w.put(k, value(k, 4 * KB))
            spare = w.spares._held[0] if w.spares._held else None
            assert spare is not None
            handed.append(spare.name)
            if w.config.client_id in before:  # the one placed after the last answer
                assert spare.name == before[w.config.client_id][0]
            wait_until(lambda: w.config.client_id in m._ahead, 10, "the next spare placed")
            assert len(spare_rows(m)) == 2  # the client's one and the one placed ahead
        assert len(set(handed)) == len(keys) and w.spares.used == len(keys) - 1
        assert [r.get(k) == value(k, 4 * KB) for k in keys] == [True] * len(keys)
        w.close()  # gives back its spare; the one placed ahead goes with that PutEnd
        assert spare_rows(m) == {} and m._ahead == {}


def test_a_spare_placed_ahead_gets_a_fresh_write_window_when_handed_out():
    clock = Clock()
    window = 10.0
    with pool(clock, write_window=window) as (m, addr), \
            StoreClient(master=addr, protocol="tcp") as w:
        w.put("fresh-0", value("fresh-0", 4 * KB))
        wait_until(lambda: w.config.client_id in m._ahead, 10, "a spare placed ahead")
        ahead = m._ahead[w.config.client_id][0]
        with m.lock:  # (the timer's pass takes it too: no client expires in between)
            clock.advance(3 * window)  # long past the window it was placed with
            for cid in list(m.state.clients):
                m.state.clients[cid].last_seen = clock()
        w.put("fresh-1", value("fresh-1", 4 * KB))  # hands the one placed ahead out
        held = w.spares._held
        assert held is not None and held[0].name == ahead
        assert spare_rows(m)[ahead] >= clock() + window - 1e-6
        w.put("fresh-2", value("fresh-2", 4 * KB))  # and it is written and committed
        assert w.spares.used == 2 and w.get("fresh-2") == value("fresh-2", 4 * KB)


def test_a_put_of_another_shape_frees_the_spare_placed_ahead():
    with pool() as (m, addr), StoreClient(master=addr, protocol="tcp") as w:
        w.put("shape-0", value("shape-0", 4 * KB))
        wait_until(lambda: w.config.client_id in m._ahead, 10, "a spare placed ahead")
        small = m._ahead[w.config.client_id][0]
        w.put("shape-1", value("shape-1", 8 * KB))  # another size: the usual way
        assert small not in spare_rows(m)  # freed, not left to its release timeout
        wait_until(lambda: w.config.client_id in m._ahead, 10, "a spare of the new shape")
        assert len(spare_rows(m)) == 2
        w.put_batch(["shape-2", "shape-3"], [value("shape-2", KB), value("shape-3", KB)])
        assert w.config.client_id not in m._ahead  # a PutEnd that asks for none drops it
