"""The SSD tier against a real master and a real ``kvplane segment --disk-dir`` process."""

import os

import numpy as np
import pytest

from kvplane.store.client.client import StoreClient
from kvplane.store.client.replica_ops import ReplicaOps
from kvplane.store.disk import layout
from kvplane.store.errors import ObjectNotFound
from tests.support.store_procs import spawn_master, spawn_segment

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
MB = 1 << 20


def tiers(client, keys):
    """key -> the tiers its replicas are on, as the master's descriptors say."""
    return {k: sorted(i.tier for i in r.replicas)
            for k, r in zip(keys, ReplicaOps(client).descs(keys))}


def disk_bytes(root):
    """Bytes the disk tier's files hold now (a file the segment deletes while we walk the
    directory counts as gone: the segment evicts concurrently with the gets)."""
    total = 0
    for p in root.rglob("*.kv"):
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            continue
        total += layout.file_bytes(0, size - layout.FOOTER.size)
    return total


def test_filled_past_dram_every_object_reads_back_with_its_bytes(tmp_path):
    with spawn_master() as m:
        addr = m.info["master"]
        with spawn_segment(addr, "16MiB", "--disk-dir", str(tmp_path), "--disk-size", "256MiB"), \
                StoreClient(master=addr, timeout=10) as c:
            values = {f"fill-{i}": os.urandom(MB) for i in range(48)}  # 3x the DRAM
            for key, value in values.items():
                c.put(key, value)
            where = tiers(c, list(values))
            assert sum(1 for t in where.values() if t == ["local_disk"]) >= 24  # disk only
            assert all(t for t in where.values())
            for key, value in values.items():  # sequential: far more than DRAM within a lease
                assert c.get(key) == value, key
            got = c.get_batch(list(values)[:8])
            assert got == [values[k] for k in list(values)[:8]]


def test_the_disk_quota_holds_and_what_it_dropped_is_missing_not_wrong(tmp_path):
    quota = 8 * MB
    with spawn_master() as m:
        addr = m.info["master"]
        with spawn_segment(addr, "8MiB", "--disk-dir", str(tmp_path), "--disk-size", "8MiB",
                           "--disk-write-through"), StoreClient(master=addr, timeout=10) as c:
            values = {f"q-{i}": os.urandom(MB // 2) for i in range(80)}  # 40 MiB into 16
            for key, value in values.items():
                c.put(key, value)
                assert disk_bytes(tmp_path) <= quota
            readable = 0
            for key, value in values.items():
                try:
                    assert c.get(key) == value, key
                    readable += 1
                except ObjectNotFound:
                    pass
                assert disk_bytes(tmp_path) <= quota
            assert 12 <= readable < 80
            assert c.get("q-79") == values["q-79"]


def test_mooncake_setup_with_ssd_offload_gives_local_disk_descriptors(tmp_path):
    from kvplane.compat.mooncake import MooncakeDistributedStore

    with spawn_master() as m:
        store = MooncakeDistributedStore()
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MB, 16 * MB, "tcp", "",
                           m.info["master"], None, True, str(tmp_path)) == 0
        try:
            values = {f"mc-{i}": os.urandom(MB) for i in range(40)}  # 2.5x the segment
            for key, value in values.items():
                assert store.put(key, value) == 0
            descs = store.batch_get_replica_desc(list(values))
            disk = [d for ds in descs.values() for d in ds if d.is_local_disk_replica()]
            assert len(disk) >= 20 and not any(d.is_memory_replica() for d in disk)
            assert all(d.get_disk_descriptor().file_path.startswith(str(tmp_path)) for d in disk)
            cold = next(k for k, ds in descs.items()
                        if ds and all(d.is_local_disk_replica() for d in ds))
            buf = np.zeros(64, np.uint8)  # a range read of a disk-only object promotes it
            assert store.register_buffer(buf.ctypes.data, buf.nbytes) == 0
            assert store.get_into_ranges([buf.ctypes.data], [[cold]], [[[0]]], [[[1000]]],
                                         [[[64]]]) == [[[64]]]
            assert buf.tobytes() == values[cold][1000:1064]
            assert any(d.is_memory_replica() for d in store.get_replica_desc(cold))
            assert all(store.get(k) == v for k, v in values.items())
        finally:
            store.close()
