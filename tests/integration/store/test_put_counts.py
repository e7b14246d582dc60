"""The status document's put count (issue 28, finding 5): every put path counts once per object
committed: puts through spares (two round trips, no PutStart: the default), puts with
``KVPLANE_STORE_SPARES=0``, batch puts and upserts. Counts, not rates, so nothing here depends
on timing. A real master and segment process; the clients are in this process, over TCP."""

from __future__ import annotations

import httpx
import pytest

from kvplane.store.client.client import StoreClient
from tests.support.auth import headers
from tests.support.store_procs import spawn_master, spawn_segment

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
N = 50
SIZE = 4096


@pytest.fixture(scope="module")
def pool():
    with spawn_master() as m, spawn_segment(m.info["master"], "32MiB"):
        yield m.info["master"], f"http://127.0.0.1:{m.info['admin_port']}"


def puts(admin: str) -> int:
    doc = httpx.get(f"{admin}/status", headers=headers(), timeout=10, trust_env=False).json()
    return doc["ops"]["total"]["put"]


def value(key: str) -> bytes:
    return (key.encode() * (SIZE // len(key) + 1))[:SIZE]


@pytest.mark.parametrize("spares", ["1", "0"], ids=["spares", "no-spares"])
def test_every_single_put_counts_once(pool, monkeypatch, spares):
    addr, admin = pool
    monkeypatch.setenv("KVPLANE_STORE_SPARES", spares)
    keys = [f"one-{spares}-{i}" for i in range(N)]
    with StoreClient(master=addr, protocol="tcp") as c:
        before = puts(admin)
        for k in keys:
            c.put(k, value(k))
        assert (c.spares.used > N // 2) == (spares == "1")  # the path under test was taken
        assert puts(admin) - before == N
        assert all(c.get(k) == value(k) for k in keys)


def test_batch_puts_and_upserts_count_once_per_object(pool):
    addr, admin = pool
    keys = [f"batch-{i}" for i in range(N)]
    with StoreClient(master=addr, protocol="tcp") as c:
        before = puts(admin)
        assert c.put_batch(keys, [value(k) for k in keys]) == [None] * N
        for k in keys[:10]:
            c.upsert(k, value(k[::-1]))
        assert puts(admin) - before == N + 10
        assert c.get(keys[0]) == value(keys[0][::-1]) and c.get(keys[-1]) == value(keys[-1])
