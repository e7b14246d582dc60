"""Puts after a read-back from the SSD tier (issue 28, finding 4): reading back objects fills
memory with copies their readers' leases keep (promoted from disk, or resident), and eviction
skips leased objects. A put must then wait for room within its deadline (the master names the
first lease's end with ``retry_after``) instead of failing at once; and promotion never takes a
segment past the eviction watermark (unit-tested in tests/unit/store/test_tiers_state.py), so
promoted copies alone never lock puts out.

A real master (3 s read lease, under the 5 s put deadline) and ``kvplane segment --disk-dir``
process: 8 MiB of memory, a 128 MiB write-through disk tier. 320 checksummed values of 64 KiB
(2.5x the memory) are put, every one is read back (the oldest 160 from disk), then 120 new
values are put in batches of 8: none may fail (the original code failed all 120 at once, in
0.11 s a batch), and every value reads back with its bytes.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvplane.store.client.client import StoreClient
from kvplane.store.client.replica_ops import ReplicaOps
from tests.support.services import wait_until
from tests.support.store_procs import spawn_master, spawn_segment

pytestmark = [pytest.mark.fault, pytest.mark.timeout(180)]
SIZE = 64 << 10
TIMEOUT = 5.0
BATCH = 8
LEASE = 3.0  # read lease, seconds (under the put deadline; the default 10 s is not)


def value(key: str) -> bytes:
    return np.random.default_rng(abs(hash(key)) % (1 << 32)).bytes(SIZE)


def disk_only(client: StoreClient, keys: list[str]) -> int:
    return sum(1 for r in ReplicaOps(client).descs(keys)
               if r.replicas and all(i.tier == "local_disk" for i in r.replicas))


def test_after_a_disk_read_back_puts_succeed_within_their_deadline(tmp_path):
    with spawn_master("--lease-ttl", str(LEASE)) as m, \
            spawn_segment(m.info["master"], "8MiB", "--disk-dir", str(tmp_path), "--disk-size",
                          "128MiB", "--disk-write-through"), \
            StoreClient(master=m.info["master"], timeout=TIMEOUT, checksum=True) as c:
        old = [f"old-{i}" for i in range(320)]
        for k in old:
            c.put(k, value(k))
        wait_until(lambda: disk_only(c, old[:160]) == 160, 30, "the oldest objects on disk only")
        back = old  # read back every object: leased in memory (resident, or promoted from disk)
        for i in range(0, len(back), 32):
            assert c.get_batch(back[i:i + 32]) == [value(k) for k in back[i:i + 32]]
        failed, slowest = [], 0.0
        news = [f"new-{i}" for i in range(120)]
        for i in range(0, len(news), BATCH):  # batches, as a KV connector saves blocks
            keys = news[i:i + BATCH]
            t0 = time.monotonic()
            got = c.put_batch(keys, [value(k) for k in keys])
            took = time.monotonic() - t0
            failed += [(k, round(took, 3), repr(e)) for k, e in zip(keys, got) if e is not None]
            slowest = max(slowest, took)
        print(f"failed puts: {len(failed)} (first: {failed[:3]}); slowest put {slowest:.2f} s")
        assert failed == []
        assert slowest <= TIMEOUT + 1.0
        for keys in (back, news):
            for i in range(0, len(keys), 16):
                assert c.get_batch(keys[i:i + 16]) == [value(k) for k in keys[i:i + 16]]
