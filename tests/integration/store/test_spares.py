"""Two-round-trip puts (``store/client/spares.py``): after its first put, a client's puts of one
small object write into space the master placed with the previous PutEnd and commit with one
PutEnd. Master and segments are processes; clients are in this process, over TCP. Every value
is distinct per key and per write, so a misplaced write or a stale read shows up as wrong bytes."""

from __future__ import annotations

import collections
import contextlib

import httpx
import numpy as np
import pytest

from kvplane.store.client.client import StoreClient
from kvplane.store.client.put_path import PUTS
from tests.support.auth import headers
from tests.support.services import wait_until
from tests.support.store_client_proc import round_value
from tests.support.store_procs import segment_pool, spawn_master, spawn_segment, tenant_pool

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
SIZE = 4096
COMMITTED, ANEW = PUTS.labels("committed"), PUTS.labels("put_anew")


@pytest.fixture(scope="module")
def pool():
    with segment_pool() as got:
        yield got


@contextlib.contextmanager
def counted(client: StoreClient):
    """Counts the master RPCs ``client`` makes, by method."""
    calls: collections.Counter[str] = collections.Counter()
    real = client.rpc.call

    def call(method, *a, **kw):  # type: ignore[no-untyped-def]
        calls[method] += 1
        return real(method, *a, **kw)

    client.rpc.call = call  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        client.rpc.call = real  # type: ignore[method-assign]


def put_all(client: StoreClient, keys: list[str], round_: int = 0) -> None:
    for k in keys:
        client.put(k, round_value(k, round_, SIZE).tobytes())


def wrong_bytes(client: StoreClient, keys: list[str], round_: int = 0) -> int:
    """Bytes that differ from what round ``round_`` wrote, over every key (a miss counts whole)."""
    bad = 0
    for k, got in zip(keys, client.get_batch(keys)):
        want = round_value(k, round_, SIZE)
        if isinstance(got, bytes) and len(got) == SIZE:
            bad += int(np.count_nonzero(np.frombuffer(got, np.uint8) != want))
        else:
            bad += SIZE
    return bad


def test_every_put_after_the_first_is_a_write_and_one_put_end(pool):
    addr, _ = pool
    keys = [f"two-hop-{i}" for i in range(60)]
    committed = COMMITTED._value.get()
    with StoreClient(master=addr, protocol="tcp") as w, \
            StoreClient(master=addr, protocol="tcp", checksum=True) as r:
        with counted(w) as calls:
            put_all(w, keys)
        assert calls["put_start"] == 1 and calls["put_end"] == len(keys)
        assert w.spares.used == len(keys) - 1
        assert COMMITTED._value.get() == committed + len(keys) - 1  # the metric says so too
        assert wrong_bytes(r, keys) == 0  # checksummed reads by another client


def test_a_spare_put_of_a_key_that_exists_leaves_the_first_value(pool):
    addr, _ = pool
    with StoreClient(master=addr, protocol="tcp") as w:
        put_all(w, ["exists-a", "exists-b"])  # the second put left a spare
        used = w.spares.used
        w.put("exists-a", round_value("exists-a", 1, SIZE).tobytes())  # no error: a no-op
        assert w.spares.used == used + 1
        with StoreClient(master=addr, protocol="tcp", checksum=True) as r:
            assert wrong_bytes(r, ["exists-a", "exists-b"], 0) == 0
        put_all(w, ["exists-c"])  # the spare the refused commit dropped was replaced
        assert w.spares.used == used + 2


def test_other_shapes_go_the_usual_way_and_give_the_spare_back(pool):
    addr, _ = pool
    with StoreClient(master=addr, protocol="tcp") as w, counted(w) as calls:
        w.put("shape-0", b"x" * SIZE)
        w.put("shape-1", b"y" * (SIZE + 1))  # another size: PutStart again
        w.put("shape-2", b"z" * (SIZE + 1))  # the spare of that size
        assert calls["put_start"] == 2 and w.spares.used == 1
        assert w.get("shape-1") == b"y" * (SIZE + 1) and w.get("shape-2") == b"z" * (SIZE + 1)
        w.upsert("shape-2", b"u" * (SIZE + 1))  # upserts never use a spare
        assert calls["put_start"] == 3 and w.get("shape-2") == b"u" * (SIZE + 1)


def test_spares_off_makes_every_put_three_round_trips(pool):
    addr, _ = pool
    with StoreClient(master=addr, protocol="tcp", spares=False) as w, counted(w) as calls:
        put_all(w, [f"off-{i}" for i in range(5)])
        assert calls["put_start"] == 5 and w.spares.used == 0


def test_a_master_restart_keeps_what_spares_put_and_an_old_spare_still_puts():
    m = spawn_master()
    addr = m.info["master"]
    port = addr.rsplit(":", 1)[1]
    seg = spawn_segment(addr, "32MiB")
    m2 = None
    before = [f"restart-old-{i}" for i in range(10)]
    try:
        # no heartbeat during the test: one would tell the client to remount, and a client
        # that remounts forgets its spares (the put below would not try the old one)
        with StoreClient(master=addr, protocol="tcp", timeout=10.0, heartbeat_interval=60.0) as w:
            put_all(w, before)  # 9 through spares; holds a spare of the first master
            assert w.spares.used == len(before) - 1
            m.kill()
            m.stop()
            m2 = spawn_master("--port", port)
            # the records the client wrote in front of its values (keyed by the spare's secret)
            # are what the segment re-registers with the new master: every object comes back
            health = f"http://127.0.0.1:{m2.info['admin_port']}/health"
            wait_until(lambda: httpx.get(health, headers=headers()).json()["keys"] == len(before),
                       20, "the segment re-registered every object")
            with StoreClient(master=addr, protocol="tcp", checksum=True) as r:
                assert wrong_bytes(r, before) == 0
            used, anew = w.spares.used, ANEW._value.get()
            with counted(w) as calls:
                put_all(w, ["restart-2"])  # the old spare is fenced or unknown: the usual way
            assert w.spares.used == used and calls["put_start"] == 1
            assert ANEW._value.get() == anew + 1  # it was tried first
            with counted(w) as calls:
                put_all(w, ["restart-3", "restart-4"])  # through spares of the new master
            assert w.spares.used == used + 2 and calls["put_start"] == 0
            with StoreClient(master=addr, protocol="tcp", checksum=True) as r:
                assert wrong_bytes(r, ["restart-2", "restart-3", "restart-4"]) == 0
    finally:
        seg.stop()
        if m2 is not None:
            m2.stop()
        m.stop()


def test_a_tenant_gets_no_spares_and_its_puts_work():
    with tenant_pool("svc-token", {"acme": "acme-token"}) as (_, addr, _seg):
        with StoreClient(master=addr, token="acme-token", protocol="tcp") as t, counted(t) as calls:
            put_all(t, [f"tenant-{i}" for i in range(4)])
            assert calls["put_start"] == 4 and t.spares.used == 0
            assert wrong_bytes(t, [f"tenant-{i}" for i in range(4)]) == 0


def test_threads_sharing_a_client_never_write_into_one_spare_twice(pool, monkeypatch):
    import threading

    from kvplane.store.client import replica_io

    addr, _ = pool
    keys = [[f"threads-{t}-{i}" for i in range(40)] for t in range(4)]
    errors: list[BaseException] = []
    slots: collections.Counter[tuple[int, int]] = collections.Counter()  # (thread, slot) writes
    real = replica_io.put_small

    def put_small(ctx, *a, **kw):  # type: ignore[no-untyped-def]
        done = real(ctx, *a, **kw)
        if done:
            slots[(threading.get_ident(), ctx.staging.slot().addr)] += 1
        return done

    monkeypatch.setattr(replica_io, "put_small", put_small)
    with StoreClient(master=addr, protocol="tcp") as w:
        def run(mine: list[str]) -> None:
            try:
                put_all(w, mine)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(k,)) for k in keys]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == [] and w.spares.used > 0
        # every put was one WRITE from its thread's staging slot, one slot per thread
        assert sum(slots.values()) == sum(map(len, keys))
        assert len(slots) == len({t for t, _ in slots}) == len(keys)
        with StoreClient(master=addr, protocol="tcp", checksum=True) as r:
            assert wrong_bytes(r, [k for ks in keys for k in ks]) == 0
