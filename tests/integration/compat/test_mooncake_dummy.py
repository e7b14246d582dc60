"""Dummy-client mode: ``kvplane client-server`` (the real client) serves light processes that
call ``setup_dummy``; their bytes move between their shared memory and the pool directly."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from kvplane.compat.mooncake import MooncakeDistributedStore, ReplicateConfig
from tests.support.store_procs import spawn_client_server, spawn_master

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def services():
    with spawn_master() as m, spawn_client_server(m.info["master"], "64MiB") as cs:
        yield m.info["master"], cs.info["client_server"], cs


@pytest.fixture
def dummy(services):
    st = MooncakeDistributedStore()
    assert st.setup_dummy(8 << 20, 4 << 20, services[1]) == 0
    yield st
    st.close()


def test_dummy_does_the_store_calls_through_the_real_client(services, dummy):
    master, _, _ = services
    assert dummy.get_hostname() == _real_segment(services)
    assert dummy.put("d-k", b"hello") == 0 and dummy.get("d-k") == b"hello"
    assert dummy.is_exist("d-k") == 1 and dummy.get_size("d-k") == 5
    assert dummy.get_batch(["d-k", "d-none"]) == [b"hello", b""]
    assert dummy.batch_is_exist(["d-k", "d-none"]) == [1, 0]
    cfg = ReplicateConfig()
    cfg.replica_num = 0
    assert dummy.put("d-bad", b"x", cfg) == -600
    # another, ordinary client of the same master sees what the dummy wrote
    other = MooncakeDistributedStore()
    assert other.setup("127.0.0.1", "P2PHANDSHAKE", 0, 1 << 20, "tcp", "", master) == 0
    try:
        assert other.get("d-k") == b"hello"
    finally:
        other.close()
    assert dummy.remove("d-k", True) == 0 and dummy.get("d-k") == b""
    assert dummy.health_check() == 0


def _real_segment(services):
    return services[2].info["segment"]


def test_mem_pool_memory_is_zero_copy_and_private_memory_is_staged(dummy):
    ptr = dummy.alloc_from_mem_pool(4096)
    assert ptr != 0
    pool = (ctypes.c_ubyte * 4096).from_address(ptr)
    ctypes.memset(ptr, 7, 4096)
    assert dummy.register_buffer(ptr, 4096) == 0
    assert dummy.put_from("d-pool", ptr, 4096) == 0 and dummy.get("d-pool") == b"\x07" * 4096
    private = np.arange(256, dtype=np.uint8)
    assert dummy.register_buffer(private.ctypes.data, 256) == 0
    assert dummy.put_from("d-priv", private.ctypes.data, 256) == 0
    out = np.zeros(256, np.uint8)
    assert dummy.register_buffer(out.ctypes.data, 256) == 0
    assert dummy.get_into("d-priv", out.ctypes.data, 256) == 256
    assert np.array_equal(out, private)
    ctypes.memset(ptr, 0, 4096)
    assert dummy.get_into("d-priv", ptr, 4096) == 256 and bytes(pool[:4]) == bytes(range(4))
    unregistered = np.zeros(16, np.uint8)
    assert dummy.get_into("d-priv", unregistered.ctypes.data, 16) < 0
    assert dummy.get_into_ranges([ptr], [["d-priv"]], [[[0]]], [[[100]]], [[[8]]]) == [[[8]]]
    assert bytes(pool[:8]) == bytes(range(100, 108))
    h = dummy.get_buffer("d-priv")
    assert bytes(memoryview(h)) == private.tobytes()
    assert [d.is_memory_replica() for d in dummy.get_replica_desc("d-priv")] == [True]


def test_a_real_client_has_no_mem_pool(services):
    st = MooncakeDistributedStore()
    assert st.setup("127.0.0.1", "P2PHANDSHAKE", 0, 1 << 20, "tcp", "", services[0]) == 0
    try:
        assert st.alloc_from_mem_pool(4096) == 0
    finally:
        st.close()


def test_setup_dummy_errors():
    st = MooncakeDistributedStore()
    with pytest.raises(TypeError):
        st.setup_dummy(-1, 0, "127.0.0.1:1")
    with pytest.raises(TypeError):
        st.setup_dummy(1 << 20, 1 << 20, 50052)
    from tests.support.services import free_port

    assert st.setup_dummy(1 << 20, 1 << 20, f"127.0.0.1:{free_port()}") == -900
    assert st.health_check() == 1


_CHILD = """
import sys
from kvplane.compat.mooncake import MooncakeDistributedStore
st = MooncakeDistributedStore()
assert st.setup_dummy(4 << 20, 1 << 20, sys.argv[1]) == 0
assert st.put("d-child", b"from the child") == 0
print("ready", flush=True)
sys.stdin.readline()
"""


def test_a_dead_dummy_is_detached_and_the_server_keeps_serving(services, dummy):
    """kill -9 of a dummy: the server drops its mappings; other dummies go on."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    before = _sessions(services[1])
    with subprocess.Popen([sys.executable, "-c", _CHILD, services[1]], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, env=env, text=True) as child:
        try:
            assert child.stdout.readline().strip() == "ready"
            assert _sessions(services[1]) == before + 1
        finally:
            child.kill()
            child.wait(10)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and _sessions(services[1]) != before:
        time.sleep(0.1)
    assert _sessions(services[1]) == before  # the liveness pass detached it
    assert dummy.get("d-child") == b"from the child"
    assert dummy.put("d-after", b"ok") == 0 and dummy.get("d-after") == b"ok"


def _sessions(address):
    from kvplane.common.auth import client_token
    from kvplane.common.rpc import RpcClient
    from kvplane.store.dummy.types import SessionReq

    rpc = RpcClient(address, client_token())
    try:
        return rpc.call("sessions", SessionReq(""), int)
    finally:
        rpc.close()
