"""Issue 28, finding 1, path by path: no read returns bytes whose transfer ended after the read
lease that covers it (docs/store.md, "Guarantees").

A read that overran its lease is made deterministic here: the reader's transfers complete, then
fill the reader's buffer with bytes of no object (what a stalled segment serves from space the
master has handed out again) and move the reader's clock past every lease it holds (the read
"ended" long after). Every get path must then fail (``LeaseExpired``), never return those bytes;
with the clock left alone the same reads return the object. Master and segment are in this
process; the reader reads over TCP (held reads need the segment's listener)."""

from __future__ import annotations

import time
import types
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvplane.common.errors import KVPlaneError
from kvplane.compat.mooncake_store import MooncakeDistributedStore
from kvplane.store import MasterServer, StoreClient
from kvplane.store.client import get_path, lookup, put_path, ranges, replica_io, timing
from kvplane.store.client.ranges import Ranges
from kvplane.store.errors import LeaseExpired
from tests.support.store_client_proc import value_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
SIZE = 64 << 10
GARBAGE = 0xEE  # no value_of() byte pattern is all 0xEE


@pytest.fixture(scope="module")
def pool() -> Iterator[str]:
    with MasterServer(admin_port=None) as m:
        addr = f"127.0.0.1:{m.port}"
        with StoreClient(master=addr, global_segment_size=16 << 20) as seg:
            seg.put("victim", value_of("victim", SIZE).tobytes())
            seg.put("other", value_of("other", SIZE).tobytes())
            yield addr


class Late:
    """The reader's clock (as its store client modules read it), and transfers that end late."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, reader: StoreClient,
                 times: int | None = None) -> None:
        self.skew = 0.0
        self.late_reads = 0
        self.times = times  # how many reads end late (None: every one)
        clock = types.SimpleNamespace(monotonic=lambda: time.monotonic() + self.skew,
                                      time=time.time, sleep=time.sleep)
        for mod in (get_path, lookup, put_path, ranges, replica_io, timing):
            monkeypatch.setattr(mod, "time", clock)
        eng = reader.engine
        view = eng.memory.view

        def late(local: int, n: int) -> None:
            if self.times is not None and self.late_reads >= self.times:
                return
            view(local, n)[:] = bytes([GARBAGE]) * n  # what the late read brought back
            self.skew += 1000.0  # ... long after every lease this reader holds
            self.late_reads += 1

        real_many, real_one, real_transfer = eng.read_many, eng.read_one, eng.transfer

        def read_many(items, timeout=None):
            got = real_many(items, timeout)
            for it in items:
                late(it[1], it[3])
            return got

        def read_one(handle, local, remote, length, gen=0, timeout=None):
            got = real_one(handle, local, remote, length, gen, timeout)
            late(local, length)
            return got

        def transfer(reqs, timeout=None, *a, **kw):  # Ranges' reads
            got = real_transfer(reqs, timeout, *a, **kw)
            for r in reqs:
                late(r.source, r.length)
            return got

        monkeypatch.setattr(eng, "read_many", read_many)
        monkeypatch.setattr(eng, "read_one", read_one)
        monkeypatch.setattr(eng, "transfer", transfer)


def _buf(c: StoreClient) -> tuple[np.ndarray, int]:
    buf = np.zeros(SIZE, np.uint8)
    return buf, c.register_buffer(buf)


def get(c: StoreClient) -> bytes:
    return c.get("victim")


def get_into(c: StoreClient) -> bytes:
    buf, addr = _buf(c)
    return buf[:c.get_into("victim", addr, SIZE)].tobytes()


def batch_get_into(c: StoreClient) -> bytes:
    buf, addr = _buf(c)
    n = c.batch_get_into(["victim"], [addr], [SIZE])[0]
    if isinstance(n, KVPlaneError):
        raise n
    return buf[:n].tobytes()


def batch_of_two(c: StoreClient) -> bytes:
    got = c.get_batch(["other", "victim"])
    for g in got:
        if isinstance(g, KVPlaneError):
            raise g
    assert got[0] == value_of("other", SIZE).tobytes()
    return got[1]


def ranges_read(c: StoreClient) -> bytes:
    """Mooncake's get_into_ranges / get sessions: one lookup, then range reads."""
    buf, addr = _buf(c)
    io = Ranges(c)
    results, lease_end = io.lookup(["victim"])
    n = io.read(results[0], [(0, addr, SIZE)], lease_end)[0]
    if n < 0:
        raise LeaseExpired(f"range read failed ({n})")
    return buf[:n].tobytes()


def _facade(c: StoreClient) -> MooncakeDistributedStore:
    st = MooncakeDistributedStore()
    st._c, st._local_buffer = c, c.config.local_buffer_size  # this reader, set up already
    return st


def mooncake_get(c: StoreClient) -> bytes:
    got = _facade(c).get("victim")
    if not got:
        raise LeaseExpired("the facade's get failed (b'')")
    return got


def mooncake_get_into(c: StoreClient) -> bytes:
    buf, addr = _buf(c)
    n = _facade(c).get_into("victim", addr, SIZE)
    if n < 0:
        raise LeaseExpired(f"the facade's get_into failed ({n})")
    return buf[:n].tobytes()


# name: (read, warm first, held reads): warm with held reads off: speculative; warm with them
# on: held (no lookup); cold: the lookup, then the read
CASES: dict[str, tuple[Callable[[StoreClient], bytes], bool, bool]] = {
    "cold_get": (get, False, True),
    "cold_get_into": (get_into, False, True),
    "cold_batch_get_into": (batch_get_into, False, True),
    "speculative_get": (get, True, False),
    "speculative_get_into": (get_into, True, False),
    "speculative_batch_get_into": (batch_get_into, True, False),
    "speculative_batch_of_two": (batch_of_two, True, False),
    "held_get": (get, True, True),
    "held_one": (get_into, True, True),
    "held_batch_get_into": (batch_get_into, True, True),
    "ranges": (ranges_read, False, True),
    "mooncake_get": (mooncake_get, True, True),
    "mooncake_get_into": (mooncake_get_into, True, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_read_that_ended_after_its_lease_is_not_returned(pool, monkeypatch, case):
    read, warm, held = CASES[case]
    victim = value_of("victim", SIZE).tobytes()
    cache = {} if warm else {"location_cache": 0}  # cold: every get looks the key up
    with StoreClient(master=pool, protocol="tcp", held_reads=held, **cache) as reader:
        assert read(reader) == victim  # the clock left alone: the object's bytes
        if warm:
            assert reader.locations.get("victim") is not None
        late = Late(monkeypatch, reader)
        try:
            got = read(reader)
        except LeaseExpired:
            got = None
        assert late.late_reads >= 1
        assert got is None, f"{case}: bytes read after the lease returned as success"


ONCE = ["speculative_get", "speculative_get_into", "speculative_batch_get_into",
        "speculative_batch_of_two", "held_get", "held_one", "held_batch_get_into"]


@pytest.mark.parametrize("case", ONCE)
def test_after_a_late_read_the_key_is_looked_up_and_read_again(pool, monkeypatch, case):
    """Only the first read ends late (a transport past its timeout, the segment healthy):
    its bytes are dropped, and the fresh lookup's read returns the object within the call."""
    read, _, held = CASES[case]
    victim = value_of("victim", SIZE).tobytes()
    with StoreClient(master=pool, protocol="tcp", held_reads=held) as reader:
        assert read(reader) == victim
        late = Late(monkeypatch, reader, times=1)
        assert read(reader) == victim
        assert late.late_reads == 1


def test_the_engine_backends_load_through_the_bounded_client(pool, monkeypatch):
    """SGLang's HiCache backend (``batch_get_v1``: ``batch_get_into``; ``get``: ``get_batch``)
    and LMCache's (``batch_get_into``, ``get_batch``) load through the plain StoreClient their
    settings open, so a late read is discarded there too. (vLLM's store connector opens a
    StoreClient the same way, ``store_connector.store_client``, and loads with
    ``batch_get_into``; vLLM is not needed for the rest of this test.)"""
    from kvplane.integrations.store_backend import StoreBackendConfig

    cfg = StoreBackendConfig.from_mapping({"master_server_address": pool, "protocol": "tcp"})
    with cfg.open_client() as client:
        assert type(client) is StoreClient
        assert batch_get_into(client) == value_of("victim", SIZE).tobytes()
        Late(monkeypatch, client)
        with pytest.raises(LeaseExpired):
            batch_get_into(client)
        got = client.get_batch(["victim"])[0]
        assert isinstance(got, LeaseExpired), got
