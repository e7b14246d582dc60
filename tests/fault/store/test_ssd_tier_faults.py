"""The SSD tier under faults: a node killed (-9) and restarted, the whole cluster restarted,
a torn file on disk."""

import os

import pytest

from kvplane.store.client.client import StoreClient
from kvplane.store.client.replica_ops import ReplicaOps
from kvplane.store.disk import layout
from kvplane.store.errors import ObjectNotFound, TransferFail
from tests.support.services import wait_until
from tests.support.store_procs import spawn_master, spawn_segment

pytestmark = [pytest.mark.fault, pytest.mark.timeout(150)]
MB = 1 << 20
KEYS = [f"ssd-{i}" for i in range(12)]


def disk_node(addr, root):
    return spawn_segment(addr, "32MiB", "--disk-dir", str(root), "--disk-size", "64MiB",
                         "--disk-write-through")


def put_all_to_disk(c):
    values = {k: os.urandom(MB // 2 + i) for i, k in enumerate(KEYS)}
    for k, v in values.items():
        c.put(k, v)
    ops = ReplicaOps(c)
    wait_until(lambda: all(any(i.tier == "local_disk" for i in r.replicas)
                           for r in ops.descs(KEYS)), 30, "every object on disk")
    return values


def kill9(proc):
    proc.kill()
    proc.stop()  # closes its pipes


def all_readable(c, values):
    try:
        return all(c.get(k) == v for k, v in values.items())
    except (ObjectNotFound, TransferFail):
        return False


@pytest.mark.parametrize("after_ttl", [False, True], ids=["before-ttl", "after-ttl"])
def test_a_node_killed_and_restarted_serves_its_disk_objects_again(tmp_path, after_ttl):
    with spawn_master("--client-ttl", "2") as m:
        addr = m.info["master"]
        with StoreClient(master=addr, timeout=5) as c:
            node = disk_node(addr, tmp_path)
            values = put_all_to_disk(c)
            kill9(node)  # kill -9: its memory (every memory replica) is gone
            if after_ttl:  # the master dropped the node and its objects: they come back with it
                wait_until(lambda: not any(c.batch_exists(KEYS)), 30, "the dead node dropped")
            with disk_node(addr, tmp_path):
                wait_until(lambda: all_readable(c, values), 60, "disk objects readable again")
                for k, v in values.items():
                    assert c.get(k) == v


def test_after_a_whole_cluster_restart_the_disk_objects_are_found_again(tmp_path):
    m = spawn_master()
    node = disk_node(m.info["master"], tmp_path)
    with StoreClient(master=m.info["master"], timeout=5) as c:
        values = put_all_to_disk(c)
    kill9(node)
    kill9(m)
    with spawn_master() as m2, disk_node(m2.info["master"], tmp_path), \
            StoreClient(master=m2.info["master"], timeout=5) as c:
        wait_until(lambda: all_readable(c, values), 60, "disk objects readable after restart")
        where = {k: [i.tier for i in r.replicas] for k, r in zip(KEYS, ReplicaOps(c).descs(KEYS))}
        assert all("local_disk" in t for t in where.values())


def test_a_torn_file_is_detected_and_never_served(tmp_path):
    with spawn_master("--client-ttl", "2") as m:
        addr = m.info["master"]
        with StoreClient(master=addr, timeout=5) as c:
            node = disk_node(addr, tmp_path)
            values = put_all_to_disk(c)
            kill9(node)
            with disk_node(addr, tmp_path):  # a fresh node: its objects are on disk only
                intact = {k: v for k, v in values.items() if k != KEYS[3]}
                path = layout.path_of(tmp_path, KEYS[3])
                wait_until(lambda: all(len(r.replicas) == 1 for r in ReplicaOps(c).descs(KEYS)),
                           30, "the dead node's memory replicas dropped")
                os.truncate(path, path.stat().st_size - 1000)  # torn behind the node's back
                with pytest.raises((ObjectNotFound, TransferFail)):
                    c.get(KEYS[3])
                assert not path.exists()  # deleted, and reported lost
                wait_until(lambda: not c.exists(KEYS[3]), 10, "the torn object removed")
                for k, v in intact.items():
                    assert c.get(k) == v
