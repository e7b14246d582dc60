"""The rest of Mooncake's store API on kvplane.compat.mooncake, against a real master and
segment clients: setup forms, not-set-up codes, buffers, ranges, sessions, replica descriptors,
replica clear, copy/move tasks, ReplicateConfig validation, and a failed setup leaving nothing."""

from __future__ import annotations

import gc
import os
import threading
import time

import numpy as np
import pytest

from kvplane.compat.mooncake import (
    BufferHandle,
    MooncakeDistributedStore,
    ReplicaStatus,
    ReplicateConfig,
    SoftPinAction,
    TaskStatus,
    TaskType,
)
from kvplane.store.master.config import MasterConfig
from kvplane.store.master.server import MasterServer
from kvplane.testing.needs import requires
from tests.support.services import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
LEASE = 0.5


@pytest.fixture(scope="module")
def master_server():
    with MasterServer(MasterConfig(lease_ttl=LEASE), admin_port=None) as m:
        yield m


@pytest.fixture(scope="module")
def master(master_server):
    return f"127.0.0.1:{master_server.port}"


def _store(master: str, hostname: str = "127.0.0.1", segment: int = 16 << 20,
           buffer: int = 16 << 20) -> MooncakeDistributedStore:
    st = MooncakeDistributedStore()
    assert st.setup(hostname, "P2PHANDSHAKE", segment, buffer, "tcp", "", master) == 0
    return st


@pytest.fixture(scope="module")
def segments(master):
    stores = [_store(master, f"localhost:{free_port()}") for _ in range(3)]
    yield stores
    for st in stores:
        st.close()


@pytest.fixture
def client(master):
    st = _store(master, segment=0, buffer=32 << 20)
    yield st
    st.close()


def _wait_task(store, task_id, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        resp, err = store.query_task(task_id)
        assert err == 0
        if resp.status in (TaskStatus.SUCCESS, TaskStatus.FAILED):
            return resp
        time.sleep(0.02)
    raise AssertionError("task did not finish")


def _endpoints(store, key):
    return sorted(d.get_memory_descriptor().buffer_descriptor.transport_endpoint
                  for d in store.get_replica_desc(key) if d.is_memory_replica())


# -- setup -----------------------------------------------------------------------------------------
def test_calls_before_setup_answer_like_mooncake_without_a_connection():
    st = MooncakeDistributedStore()
    assert st.put("k", b"v") == -600 and st.get("k") == b"" and st.is_exist("k") == -600
    assert st.get_size("k") == -600 and st.remove("k") == -600 and st.remove_all() == -600
    assert st.batch_is_exist(["a", "b"]) == [-600, -600]
    assert st.batch_get_buffer(["a"]) == [None] and st.get_buffer("a") is None
    assert st.batch_put_from(["a"], [1], [1]) == [-600]
    assert st.create_copy_task("k", ["s"]) == ((0, 0), -600) and st.query_task((1, 2)) == (None, -600)
    assert st.get_replica_desc("k") == [] and st.batch_replica_clear(["k"]) == []
    assert st.health_check() == 1 and st.get_hostname() == "" and st.close() == 0


def test_setup_signatures_raise_type_error_like_pybind():
    st = MooncakeDistributedStore()
    with pytest.raises(TypeError):
        st.setup("127.0.0.1", "P2PHANDSHAKE")  # the first seven are required
    with pytest.raises(TypeError):
        st.setup("127.0.0.1", "P2PHANDSHAKE", 1 << 20, 1 << 20, "tcp", "", "h:1", bogus=1)
    with pytest.raises(TypeError):
        st.setup({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "bogus": 1})
    assert st.setup({"metadata_server": "P2PHANDSHAKE"}) == -600  # local_hostname required
    assert st.setup({"local_hostname": "h", "metadata_server": "P2PHANDSHAKE",
                     "global_segment_size": "50%"}) == -600


@pytest.mark.parametrize("key", ["master_server_addr", "master_server_address"])
def test_dict_setup_reads_mooncake_and_lmcache_spellings(master, key):
    st = MooncakeDistributedStore()
    assert st.setup({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                     "global_segment_size": "16MB", "local_buffer_size": "16 MB",
                     "protocol": "rdma", "rdma_devices": "mlx5_0", key: master}) == 0
    try:
        assert st.put("dict-k", b"v") == 0 and st.get("dict-k") == b"v"
        host, port = st.get_hostname().rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        assert st.setup({"local_hostname": "127.0.0.1", "metadata_server": "x"}) == -600  # twice
    finally:
        st.close()


def test_explicit_port_names_the_segment(master):
    port = free_port()
    st = _store(master, f"localhost:{port}")
    try:
        assert st.get_hostname() == f"localhost:{port}"
    finally:
        st.close()


def test_a_taken_host_port_sets_up_on_another_port_like_mooncake(master):
    """Mooncake's test_batch_replica_clear.py opens a second store on localhost:12345 while the
    first still holds it; Mooncake's engine never binds that port, so both set up. Here the
    second takes a port of Mooncake's client range and get_hostname() names it."""
    port = free_port()
    first = _store(master, f"localhost:{port}")
    second = MooncakeDistributedStore()
    try:
        assert second.setup(f"localhost:{port}", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "",
                            master) == 0
        host, _, other = second.get_hostname().rpartition(":")
        assert first.get_hostname() == f"localhost:{port}" and host == "localhost"
        assert 12300 <= int(other) <= 14300
        assert second.put("taken-port", b"v" * 5000) == 0 and first.get("taken-port") == b"v" * 5000
    finally:
        second.close()
        first.close()


def test_zero_local_buffer_refuses_copying_calls(master):
    st = _store(master, segment=0, buffer=0)
    try:
        assert st.put("zlb", b"v") == -600 and st.is_exist("zlb") == 0
        assert st.get("zlb") == b"" and st.get_buffer("zlb") is None
    finally:
        st.close()


def test_a_failed_setup_leaves_no_thread_socket_or_shared_memory():
    def snapshot():
        mine = f"kvplane-{os.getpid()}-"
        return (sorted(t.name for t in threading.enumerate()), len(os.listdir("/proc/self/fd")),
                sorted(f for f in os.listdir("/dev/shm") if f.startswith(mine)))

    gc.collect()  # earlier tests' garbage (a socket in a cycle) must not close during this one
    before = snapshot()
    st = MooncakeDistributedStore()
    dead = f"127.0.0.1:{free_port()}"
    assert st.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", dead) == -900
    assert st.setup("127.0.0.1", f"http://{dead}/metadata", 16 << 20, 16 << 20, "tcp", "",
                    dead) < 0
    gc.collect()
    assert snapshot() == before
    assert st.health_check() == 1


# -- buffers ---------------------------------------------------------------------------------------
def test_batch_get_buffer_returns_buffer_protocol_handles(segments, client):
    data = os.urandom(100_000)
    assert client.put("buf-k", data) == 0
    handles = client.batch_get_buffer(["buf-k", "buf-missing"])
    h = handles[0]
    assert isinstance(h, BufferHandle) and handles[1] is None
    assert h.size() == len(h) == len(data) and h.ptr() > 0
    assert bytes(memoryview(h)) == data and np.array(h, copy=False)[:4].tobytes() == data[:4]
    torch = requires("torch")
    assert bytes(torch.frombuffer(h, dtype=torch.uint8, offset=8, count=8).numpy()) == data[8:16]
    h.release()


# -- ReplicateConfig -------------------------------------------------------------------------------
def test_replicate_config_fields_and_types():
    cfg = ReplicateConfig()
    assert (cfg.replica_num, cfg.soft_pin_action, cfg.soft_pin_ttl_ms, cfg.group_ids) == \
        (1, SoftPinAction.PRESERVE, None, None)
    for field, bad in [("replica_num", -1), ("soft_pin_ttl_ms", -1), ("soft_pin_ttl_ms", 1 << 64),
                       ("soft_pin_action", 1), ("with_hard_pin", 1), ("group_ids", "ab"),
                       ("preferred_segments", [1])]:
        with pytest.raises(TypeError):
            setattr(cfg, field, bad)
    with pytest.raises(AttributeError):
        cfg.no_such_field = 1
    cfg.with_soft_pin = True
    assert cfg.soft_pin_action == SoftPinAction.ENABLE and "soft_pin_action" in str(cfg)


@pytest.mark.parametrize("setup_cfg,expect", [
    ({"replica_num": 0}, -600),
    ({"soft_pin_ttl_ms": 10}, -600),                            # TTL needs ENABLE
    ({"soft_pin_action": SoftPinAction.ENABLE, "soft_pin_ttl_ms": 25 * 3600 * 1000}, -600),
    ({"nof_replica_num": 1}, -600),
    ({"dfs_replica_num": 2}, -600),
    ({"dfs_replica_num": 1}, -1601),                            # no DFS here
    ({"prefer_alloc_in_same_node": True}, -600),                # not on the copying put
    ({"group_ids": ["a", "b"]}, -600),                          # one id per key
    ({"soft_pin_action": SoftPinAction.ENABLE, "soft_pin_ttl_ms": 0}, 0),
    ({"group_ids": ["g"]}, 0),
])
def test_replicate_config_is_validated_like_mooncake(segments, client, setup_cfg, expect):
    cfg = ReplicateConfig()
    for k, v in setup_cfg.items():
        setattr(cfg, k, v)
    key = f"cfg-{abs(hash(str(setup_cfg)))}"
    assert client.put(key, b"v", cfg) == expect
    assert client.is_exist(key) == (1 if expect == 0 else 0)


def test_soft_pin_preserve_keeps_the_deadline_and_disable_drops_it(master_server, segments, client):
    cfg = ReplicateConfig()
    cfg.soft_pin_action = SoftPinAction.ENABLE
    cfg.soft_pin_ttl_ms = 60_000
    assert client.put("pin-k", b"v1", cfg) == 0
    state = master_server.state
    first = state.objects["pin-k"].soft_pin_until
    assert first > time.monotonic() + 50
    assert client.upsert("pin-k", b"v2") == 0  # PRESERVE by default
    assert state.objects["pin-k"].soft_pin_until == first
    off = ReplicateConfig()
    off.soft_pin_action = SoftPinAction.DISABLE
    assert client.upsert("pin-k", b"v3", off) == 0
    assert state.objects["pin-k"].soft_pin_until == 0.0 and client.get("pin-k") == b"v3"


# -- ranges and sessions ---------------------------------------------------------------------------
def test_get_into_ranges_gathers_fragments_like_the_docs_example(segments, client):
    key1, key2 = bytes(range(40)), bytes(range(100, 140))
    assert client.put("rk1", key1) == 0 and client.put("rk2", key2) == 0
    b0, b1 = np.zeros(32, np.uint8), np.zeros(32, np.uint8)
    for b in (b0, b1):
        assert client.register_buffer(b.ctypes.data, b.nbytes) == 0
    res = client.get_into_ranges(
        [b0.ctypes.data, b1.ctypes.data], [["rk1", "rk2"], ["rk2", "rk1"]],
        [[[0, 20], [8]], [[4], [16]]], [[[1, 30], [2]], [[0], [10]]], [[[4, 3], [5]], [[6], [4]]])
    assert res == [[[4, 3], [5]], [[6], [4]]]
    assert b0[0:4].tobytes() == key1[1:5] and b0[20:23].tobytes() == key1[30:33]
    assert b0[8:13].tobytes() == key2[2:7] and b1[4:10].tobytes() == key2[0:6]
    assert b1[16:20].tobytes() == key1[10:14]
    bad = client.get_into_ranges([b0.ctypes.data], [["rk1", "nope"]], [[[0], [0]]],
                                 [[[38], [0]]], [[[4], [1]]])
    assert bad == [[[-600], [-704]]]  # past the object's end; a missing key
    unregistered = np.zeros(8, np.uint8)
    assert client.get_into_ranges([unregistered.ctypes.data], [["rk1"]], [[[0]]], [[[0]]],
                                  [[[4]]]) == [[[-600]]]


def test_put_and_get_sessions_move_layers_without_master_calls(segments, client):
    page, layers, keys = 1024, 4, ["sess0", "sess1"]
    src = [np.full(page, i + 1, np.uint8) for i in range(layers)]
    dst = [np.zeros(page, np.uint8) for _ in range(layers)]
    for b in src + dst:
        assert client.register_buffer(b.ctypes.data, b.nbytes) == 0
    assert client.batch_put_session_start(keys, [page * layers] * 2) == [0, 0]
    assert client.is_exist("sess0") == 0  # invisible until the end
    for layer in range(layers):
        rcs = client.batch_put_from_multi_buffer_ranges(
            keys, [[src[layer].ctypes.data]] * 2, [[page]] * 2, [[layer * page]] * 2)
        assert rcs == [page, page]
    assert client.batch_put_session_end(keys) == [0, 0]
    assert client.get("sess1") == b"".join(s.tobytes() for s in src)
    assert client.batch_get_session_start(keys + ["sess-missing"]) == [0, 0, -704]
    for layer in range(layers):
        assert client.batch_get_into_multi_buffer_ranges(
            keys[:1], [[dst[layer].ctypes.data]], [[page]], [[layer * page]]) == [page]
        assert np.array_equal(dst[layer], src[layer])
    assert client.batch_get_into_multi_buffer_ranges(["sess-missing"], [[dst[0].ctypes.data]],
                                                     [[1]], [[0]]) == [-600]
    time.sleep(LEASE + 0.1)
    assert client.batch_get_into_multi_buffer_ranges(
        keys[:1], [[dst[0].ctypes.data]], [[page]], [[0]]) == [-707]  # the lease ended
    assert client.batch_get_session_end(keys) == 0
    assert client.batch_put_session_start(["sess-rv"], [64]) == [0]
    assert client.batch_put_session_revoke(["sess-rv"]) == [0] and client.is_exist("sess-rv") == 0


def test_put_from_with_metadata_stores_metadata_then_data(segments, client):
    meta, data = np.frombuffer(b"META", np.uint8).copy(), np.arange(16, dtype=np.uint8)
    for b in (meta, data):
        client.register_buffer(b.ctypes.data, b.nbytes)
    assert client.put_from_with_metadata("pfm", data.ctypes.data, meta.ctypes.data, 16, 4) == 0
    assert client.get("pfm") == b"META" + data.tobytes()


# -- descriptors, clear, tasks ----------------------------------------------------------------------
def test_replica_descriptors_name_their_segments(segments, client):
    names = [s.get_hostname() for s in segments]
    cfg = ReplicateConfig()
    cfg.replica_num = 2
    cfg.preferred_segments = names[:2]
    assert client.put("desc-k", b"x" * 1000, cfg) == 0
    descs = client.get_replica_desc("desc-k")
    assert [d.status for d in descs] == [ReplicaStatus.COMPLETE] * 2
    assert all(d.is_memory_replica() and not d.is_disk_replica() for d in descs)
    assert {d.get_memory_descriptor().buffer_descriptor.size for d in descs} == {1000}
    assert _endpoints(client, "desc-k") == sorted(names[:2])
    assert client.batch_get_replica_desc(["desc-k", "nope"])["nope"] == []
    assert client.remove("desc-k") == 0  # descriptors take no lease


def test_copy_and_move_tasks_really_move_replicas(segments, client):
    names = [s.get_hostname() for s in segments]
    cfg = ReplicateConfig()
    cfg.preferred_segment = names[0]
    payload = os.urandom(2 << 20)
    assert client.put("task-k", payload, cfg) == 0
    task, err = client.create_copy_task("task-k", names[1:])
    assert err == 0 and task != (0, 0)
    resp = _wait_task(client, task)
    assert resp.status == TaskStatus.SUCCESS and resp.type == TaskType.REPLICA_COPY
    assert resp.created_at_ms_epoch > 0 and resp.assigned_client != (0, 0)
    assert _endpoints(client, "task-k") == sorted(names)
    for seg in segments:  # each replica holds the bytes: read each holder alone
        assert seg.get("task-k") == payload
    task, err = client.create_move_task("task-k", names[0], names[1])  # target holds one already
    assert err == 0 and _wait_task(client, task).status == TaskStatus.SUCCESS
    assert _endpoints(client, "task-k") == sorted(names[1:])
    assert client.get("task-k") == payload


def test_move_task_to_a_new_segment_frees_the_source(segments, client):
    names = [s.get_hostname() for s in segments]
    cfg = ReplicateConfig()
    cfg.preferred_segment = names[2]
    payload = os.urandom(300_000)
    assert client.put("move-k", payload, cfg) == 0
    task, err = client.create_move_task("move-k", names[2], names[0])
    assert err == 0
    resp = _wait_task(client, task)
    assert resp.status == TaskStatus.SUCCESS and resp.type == TaskType.REPLICA_MOVE
    assert _endpoints(client, "move-k") == [names[0]] and client.get("move-k") == payload


def test_task_errors_use_mooncake_codes(segments, client):
    names = [s.get_hostname() for s in segments]
    assert client.create_copy_task("no-such-key", names[1:]) == ((0, 0), -704)
    assert client.create_move_task("no-such-key", names[0], names[1]) == ((0, 0), -704)
    cfg = ReplicateConfig()
    cfg.preferred_segment = names[0]
    assert client.put("task-err", b"v", cfg) == 0
    assert client.create_copy_task("task-err", ["unknown_segment"])[1] == -600
    assert client.create_move_task("task-err", "unknown_source", names[1])[1] == -600
    assert client.create_move_task("task-err", names[0], "unknown_target")[1] == -600
    assert client.create_move_task("task-err", names[0], names[0])[1] == -600
    assert client.create_move_task("task-err", names[1], names[2])[1] == -600  # no replica there
    assert client.query_task((12345, 678)) == (None, -1400)
    with pytest.raises(TypeError):
        client.query_task("not-an-id")


def test_batch_replica_clear_takes_only_own_keys_with_ended_leases(segments, client, master):
    names = [s.get_hostname() for s in segments]
    cfg = ReplicateConfig()
    cfg.replica_num = 2
    cfg.preferred_segments = names[:2]
    keys = [f"clr-{i}" for i in range(3)]
    for k in keys:
        assert client.put(k, b"data", cfg) == 0
    assert client.get(keys[0]) == b"data"  # a read lease
    assert client.batch_replica_clear(keys) == keys[1:]  # keys[0] is leased
    other = _store(master, segment=0)
    try:
        time.sleep(LEASE + 0.1)
        assert other.batch_replica_clear([keys[0]]) == []  # not its key
    finally:
        other.close()
    assert client.batch_replica_clear([keys[0]], names[0]) == [keys[0]]
    assert _endpoints(client, keys[0]) == [names[1]]  # the other replica stays
    assert client.get(keys[0]) == b"data"
    assert client.is_exist(keys[1]) == 0 and client.batch_replica_clear([]) == []
