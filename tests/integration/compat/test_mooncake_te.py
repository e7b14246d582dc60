"""The Mooncake-compatible TransferEngine facade: names, argument order, return codes."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from kvplane.compat.mooncake import (
    ERR_ADDRESS_OVERLAPPED,
    TransferEngine,
    TransferOpcode,
)
from tests.support.target import pattern, spawn_target

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
MB = 1 << 20
BENCH_TE = pathlib.Path(__file__).resolve().parents[2] / "data/mooncake_peer/bench_te.py"


@pytest.fixture
def te():
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    yield e
    e.close()


def test_p2p_sync_and_batch(te):
    with spawn_target("--buf-mb", "4") as t:
        peer = t.info["segment"]
        assert peer == f"127.0.0.1:{t.info['port']}"
        buf = np.zeros(4 * MB, np.uint8)
        assert te.register_memory(buf.ctypes.data, buf.nbytes) == 0
        assert te.register_memory(buf.ctypes.data + 10, 10) == ERR_ADDRESS_OVERLAPPED
        r = t.info["addr"]
        assert te.transfer_sync_read(peer, buf.ctypes.data, r, MB) == 0
        assert np.array_equal(buf[:MB], pattern(MB))
        buf[:MB] = 7
        assert te.transfer_sync_write(peer, buf.ctypes.data, r + MB, MB) == 0
        assert te.transfer_sync(peer, buf.ctypes.data + MB, r + MB, MB, TransferOpcode.READ) == 0
        assert (buf[MB:2 * MB] == 7).all()
        addrs = [buf.ctypes.data + i * 4096 for i in range(8)]
        assert te.batch_transfer_sync_read(peer, addrs, [r + i * 4096 for i in range(8)], [4096] * 8) == 0
        assert te.transfer_sync_read(peer, buf.ctypes.data, r + (4 << 20), 16) == -1  # outside
        assert te.transfer_sync_read("127.0.0.1:1", buf.ctypes.data, r, 16) == -1  # nobody there
        assert te.get_first_buffer_address(peer) == r
        assert te.send_probe(peer) == 0
        assert te.unregister_memory(buf.ctypes.data) == 0
        assert te.unregister_memory(buf.ctypes.data) < 0


def test_async_status_codes(te):
    with spawn_target("--buf-mb", "4") as t:
        peer, r = t.info["segment"], t.info["addr"]
        buf = np.zeros(4 * MB, np.uint8)
        te.register_memory(buf.ctypes.data, buf.nbytes)
        bid = te.batch_transfer_async_read(peer, [buf.ctypes.data], [r], [4 * MB])
        assert bid > 0
        assert te.get_batch_transfer_status([bid]) == 0
        assert np.array_equal(buf, pattern(4 * MB))
        bid = te.transfer_submit_write(peer, buf.ctypes.data, r, MB)
        st = te.transfer_check_status(bid)
        while st == 0:
            st = te.transfer_check_status(bid)
        assert st == 1
        bad = te.batch_transfer_async_read(peer, [buf.ctypes.data], [r + (8 << 20)], [16])
        assert bad > 0 and te.get_batch_transfer_status([bad]) == -1


def test_managed_buffer_and_bytes_helpers(te):
    addr = te.allocate_managed_buffer(MB)
    assert addr
    assert te.write_bytes_to_buffer(addr, b"hello", 5) == 0
    assert te.read_bytes_from_buffer(addr, 5) == b"hello"
    assert te.free_managed_buffer(addr, MB) == 0
    assert te.allocate_managed_buffer(0) == 0
    assert json.loads(te.get_local_topology())["segment"]


def test_http_metadata_mode():
    from kvplane.transfer.metadata_server import serve_in_thread

    with serve_in_thread() as srv:
        url = f"{srv.url}/metadata"
        a, b = TransferEngine(), TransferEngine()
        try:
            assert b.initialize("127.0.0.1:0", url, "tcp", "") == 0
            port = b.get_rpc_port()
            b.close()
            b = TransferEngine()
            assert b.initialize(f"127.0.0.1:{port}", url, "tcp", "") == 0
            assert a.initialize("127.0.0.1", url, "tcp", "") == 0
            dst = np.zeros(MB, np.uint8)
            src = np.full(MB, 5, np.uint8)
            b.register_memory(dst.ctypes.data, MB)
            a.register_memory(src.ctypes.data, MB)
            assert a.transfer_sync_write(f"127.0.0.1:{port}", src.ctypes.data, dst.ctypes.data, MB) == 0
            assert (dst == 5).all()
        finally:
            a.close()
            b.close()


def test_mooncake_bench_script_runs_unchanged(tmp_path):
    env = dict(os.environ, BENCH_IMPL="kvplane")
    out = subprocess.run([sys.executable, str(BENCH_TE), "--sizes", "65536,1048576",
                          "--batch", "65536:4,1048576:2", "--buf-mb", "8", "--duration", "0.1"],
                         capture_output=True, text=True, timeout=100, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert len(rows) == 9
    assert rows[-1] == {"tag": "te", "verify_remote_bytes_ok": True}
    assert all(r["calls"] >= 3 for r in rows[:-1])


def test_opcode_names_location_and_transport_hint():
    """Mooncake spells the opcodes Read/Write; ``location`` is accepted; a hint naming a
    transport this engine has pins it (file cannot reach a memory region: -1), a hint naming
    hardware that is not here (rdma) is ignored as Mooncake's classic engine ignores it."""
    assert TransferOpcode.Read == TransferOpcode.READ == 0 and TransferOpcode.Write == 1
    from kvplane.integrations.mooncake_shim.mooncake import engine as shim_engine

    assert shim_engine.Read is TransferOpcode.Read and shim_engine.Write is TransferOpcode.Write
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "auto", "") == 0
    try:
        with spawn_target("--buf-mb", "1") as t:
            peer, r = t.info["segment"], t.info["addr"]
            buf = np.zeros(MB, np.uint8)
            assert e.register_memory(buf.ctypes.data, buf.nbytes, location="cpu:0") == 0
            buf[:16] = 9
            assert e.transfer_sync(peer, buf.ctypes.data, r, 16, TransferOpcode.Write,
                                   transport_hint="tcp") == 0
            assert e.transfer_sync_read(peer, buf.ctypes.data + 64, r, 16,
                                        transport_hint="rdma") == 0
            assert (buf[64:80] == 9).all()
            assert e.transfer_sync_read(peer, buf.ctypes.data, r, 16, transport_hint="file") == -1
            bid = e.batch_transfer_async(peer, [buf.ctypes.data], [r], [16], TransferOpcode.Read,
                                         transport_hint="shm")
            assert bid > 0 and e.get_batch_transfer_status([bid]) == 0
    finally:
        e.close()
