"""Mooncake's Python helpers on kvplane: BufferPool, the async store, MooncakeConfig, and the
shim's module layout (``mooncake``, ``mooncake.store``, ``.engine``, ``.async_store``,
``.mooncake_config``, ``.buffer_pool``)."""

from __future__ import annotations

import asyncio
import gc
import importlib
import json
import sys
import threading

import pytest

from kvplane.compat.mooncake import BufferPool, MooncakeDistributedStore
from kvplane.compat.mooncake_async import MooncakeDistributedStoreAsync
from kvplane.compat.mooncake_config import MooncakeConfig, _parse_bool, _parse_segment_size
from kvplane.integrations import mooncake_shim
from kvplane.store.master.server import MasterServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def master():
    with MasterServer(admin_port=None) as m:
        yield f"127.0.0.1:{m.port}"


@pytest.fixture
def store(master):
    st = MooncakeDistributedStore()
    assert st.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 4 << 20, "tcp", "", master) == 0
    yield st
    st.close()


def test_buffer_pool_leases_local_buffer_then_overflow(store):
    pool = BufferPool(store, min_size_class=4096, alignment=4096)
    local = pool.acquire(4 << 20)  # the whole local buffer
    over = pool.acquire(1024, block=False)  # an overflow buffer of its own
    assert local.ptr % 64 == 0 and over.size == 1024 and len(over.buffer) == 1024
    over.buffer[:4] = b"abcd"
    assert store.put_from("bp-k", over.ptr, 4) == 0 and store.get("bp-k") == b"abcd"
    with pool.buffer(16) as lease:
        assert store.get_into("bp-k", lease.ptr, lease.size) == 4
        assert bytes(lease.buffer[:4]) == b"abcd"
    over.release()
    local.release()
    pool.close()


def test_buffer_pool_limits_views_and_close(store):
    pool = BufferPool(store, min_size_class=4096, max_size_class=4096, alignment=4096,
                      max_regions=1, block_on_exhaustion=False)
    lease = pool.acquire(1)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.acquire(1)
    view = lease.buffer
    with pytest.raises(RuntimeError, match="exported views"):
        lease.release()
    with pytest.raises(RuntimeError, match="active leases"):
        pool.close()
    del view
    lease.release()
    got = []
    waiting = BufferPool(store, max_regions=1)
    held = waiting.acquire(8)
    t = threading.Thread(target=lambda: got.append(waiting.acquire(8, timeout=5.0)))
    t.start()
    held.release()  # the waiter gets it
    t.join(10)
    assert got and got[0].size == 8
    got[0].release()
    with pytest.raises(RuntimeError, match="capacity|overflow"):
        pool.acquire((1 << 64) - 1)
    with pytest.raises(RuntimeError, match="alignment"):
        BufferPool(store, alignment=12345)
    gone = pool.acquire(1)
    del gone
    gc.collect()  # a collected lease releases itself
    pool.close()
    waiting.close()


def test_async_store_runs_every_method_as_a_coroutine(master):
    st = MooncakeDistributedStoreAsync()
    assert st.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 4 << 20, "tcp", "", master) == 0

    async def main():
        assert await st.async_put("async-k", b"v") == 0
        assert await st.async_get("async-k") == b"v"
        assert await st.async_batch_is_exist(["async-k", "none"]) == [1, 0]
        return await asyncio.gather(*(st.async_put(f"async-{i}", b"x") for i in range(8)))

    try:
        assert asyncio.run(main()) == [0] * 8
        with pytest.raises(AttributeError):
            st.async_no_such_method  # noqa: B018
        with pytest.raises(AttributeError):
            st.no_such_method  # noqa: B018
    finally:
        st.close()


def test_mooncake_config_from_file_and_env(tmp_path, monkeypatch):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"local_hostname": "h", "metadata_server": "P2PHANDSHAKE",
                                "master_server_address": "m:1", "global_segment_size": "4gb",
                                "protocol": "RDMA", "enable_ssd_offload": "yes"}))
    cfg = MooncakeConfig.from_file(str(path))
    assert (cfg.global_segment_size, cfg.protocol, cfg.enable_ssd_offload) == (4 << 30, "rdma", True)
    assert cfg.local_buffer_size == 1 << 30 and cfg.tenant_id == "default"
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    with pytest.raises(ValueError):
        MooncakeConfig.load_from_env()
    monkeypatch.setenv("MOONCAKE_MASTER", "127.0.0.1:50051")
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "512 MB")
    env = MooncakeConfig.load_from_env()
    assert env.master_server_address == "127.0.0.1:50051" and env.global_segment_size == 512 << 20
    assert _parse_segment_size("1.5k") == 1536 and _parse_bool("off") is False
    with pytest.raises(ValueError):
        _parse_bool("maybe")
    with pytest.raises(ValueError):
        MooncakeConfig("h", "m", 1, 1, "tcp", "", "")  # master address required


def test_the_shim_is_a_mooncake_package(monkeypatch):
    monkeypatch.syspath_prepend(mooncake_shim.PATH)
    for name in [m for m in sys.modules if m == "mooncake" or m.startswith("mooncake.")]:
        monkeypatch.delitem(sys.modules, name)
    mc = importlib.import_module("mooncake")
    assert mc.BufferPool is BufferPool and mc.RegisteredBufferPool is BufferPool
    store_mod = importlib.import_module("mooncake.store")
    for name in ("MooncakeDistributedStore", "ReplicateConfig", "SoftPinAction", "BufferPool",
                 "MooncakeHostMemAllocator", "bind_to_numa_node", "ParallelAxis", "ReadTarget",
                 "TensorParallelism", "ReplicaStatus", "TaskStatus", "COMPLETE", "PENDING"):
        assert hasattr(store_mod, name), name
    assert importlib.import_module("mooncake.async_store").MooncakeDistributedStoreAsync
    cfg_mod = importlib.import_module("mooncake.mooncake_config")
    assert cfg_mod.MooncakeConfig is MooncakeConfig and cfg_mod.logger is not None
    assert importlib.import_module("mooncake.buffer_pool").BufferPool is BufferPool
    assert importlib.import_module("mooncake.engine").Read == 0


def test_host_mem_allocator_and_numa_binding():
    from kvplane.compat.mooncake import MooncakeHostMemAllocator, bind_to_numa_node

    alloc = MooncakeHostMemAllocator()
    ptr = alloc.alloc(1 << 20)
    assert ptr and ptr % 4096 == 0 and alloc.alloc(0) == 0
    import ctypes

    ctypes.memset(ptr, 1, 1 << 20)
    assert alloc.free(ptr) == 0 and alloc.free(ptr) == -1
    before = __import__("os").sched_getaffinity(0)
    bind_to_numa_node(0)  # node 0 exists on Linux: its CPUs
    bind_to_numa_node(999)  # no such node: a warning, nothing changes
    __import__("os").sched_setaffinity(0, before)
