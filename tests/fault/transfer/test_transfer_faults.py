"""kill -9, SIGSTOP, bad offsets, garbage and truncated frames: errors, never hangs."""

import os
import signal
import socket
import struct
import time

import numpy as np
import pytest

from kvplane.common.errors import KVPlaneError
from kvplane.transfer import OpCode, TransferEngine, TransferRequest, TransferStatus, protocol
from tests.support.services import wait_until
from tests.support.target import pattern, spawn_target

pytestmark = [pytest.mark.fault, pytest.mark.timeout(60)]
MB = 1 << 20


@pytest.fixture
def engine():
    with TransferEngine(protocol="tcp", slice_size=MB) as te:
        yield te


def test_kill9_target_mid_batch_fails_within_timeout(engine):
    with spawn_target("--buf-mb", "64") as victim, spawn_target("--buf-mb", "4") as healthy:
        local = np.zeros(64 * MB, np.uint8)
        engine.register_memory(local)
        seg = engine.open_segment(victim.info["segment"])
        reqs = [TransferRequest(OpCode.WRITE, local.ctypes.data + i * MB, seg,
                                victim.info["addr"] + i * MB, MB) for i in range(64)] * 8
        bid = engine.allocate_batch(len(reqs))
        t0 = time.monotonic()
        engine.submit(bid, reqs, timeout=10)
        victim.kill()
        statuses = engine.wait(bid, timeout=15)
        elapsed = time.monotonic() - t0
        assert all(s.done for s in statuses), statuses
        assert elapsed < 10.5
        # the dead peer shows up
        assert TransferStatus.FAILED in statuses or TransferStatus.TIMEOUT in statuses
        errors = [e for e in engine.errors(bid) if e]
        assert errors and all(isinstance(e, str) for e in errors)
        engine.free_batch(bid)
        # the initiator keeps working with other peers
        seg2 = engine.open_segment(healthy.info["segment"])
        engine.read(seg2, local.ctypes.data, healthy.info["addr"], 4 * MB, timeout=5)
        assert np.array_equal(local[:4 * MB], pattern(4 * MB))
        # and new transfers to the dead one fail fast (connection refused), not hang
        t1 = time.monotonic()
        assert engine.transfer([TransferRequest(OpCode.READ, local.ctypes.data, seg,
                                                victim.info["addr"], MB)],
                               timeout=5) == [TransferStatus.FAILED]
        assert time.monotonic() - t1 < 5


def test_stalled_peer_times_out(engine):
    with spawn_target("--buf-mb", "8") as t:
        local = np.zeros(8 * MB, np.uint8)
        engine.register_memory(local)
        seg = engine.open_segment(t.info["segment"])
        engine.read(seg, local.ctypes.data, t.info["addr"], MB)  # pooled connection exists
        t.signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            st = engine.transfer([TransferRequest(OpCode.READ, local.ctypes.data, seg,
                                                  t.info["addr"], 8 * MB)], timeout=1.5)
            elapsed = time.monotonic() - t0
            assert st == [TransferStatus.TIMEOUT]
            assert 1.0 < elapsed < 3.0
        finally:
            t.signal(signal.SIGCONT)
        # after it resumes, fresh transfers work again
        engine.read(seg, local.ctypes.data, t.info["addr"], MB, timeout=10)
        assert np.array_equal(local[:MB], pattern(MB))


def _raw(port, token=""):
    """A raw connection; with ``token`` it has said HELLO (a hostile but authenticated peer)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    if token:
        s.sendall(protocol.pack_req(protocol.OP_HELLO, 0, 0, len(token)) + token.encode())
        assert protocol.RESP.unpack(s.recv(protocol.RESP.size, socket.MSG_WAITALL))[1] == 0
    return s


def _closed(s):
    """True if the server closed the connection (closes ours too)."""
    s.settimeout(5)
    try:
        return s.recv(1 << 16) == b""
    except ConnectionResetError:
        return True
    finally:
        s.close()


def test_listener_survives_hostile_frames():
    with TransferEngine(protocol="tcp", token="t") as b, \
            TransferEngine(protocol="tcp", token="t") as a:
        dst = np.zeros(MB, np.uint8)
        b.register_memory(dst)
        addr = dst.ctypes.data
        # 1. garbage
        s = _raw(b.port, "t")
        s.sendall(os.urandom(4096))
        assert _closed(s)
        # 2. truncated header, then close
        s = _raw(b.port, "t")
        s.sendall(protocol.pack_req(protocol.OP_WRITE, 1, addr, 100)[:10])
        s.close()
        # 3. write frame whose payload never fully arrives: only what arrived lands
        s = _raw(b.port, "t")
        s.sendall(protocol.pack_req(protocol.OP_WRITE, 1, addr, 1000) + b"x" * 10)
        s.close()
        wait_until(lambda: dst[:10].tobytes() == b"x" * 10, 5, "the partial payload")
        wait_until(lambda: len(b._server._conns) == 0, 5, "server to drop the connection")
        assert not dst[10:].any()
        dst[:10] = 0
        # 4. oversized frame
        s = _raw(b.port, "t")
        s.sendall(protocol.pack_req(protocol.OP_READ, 1, addr, 1 << 40))
        assert _closed(s)
        # 5. unknown op
        s = _raw(b.port, "t")
        s.sendall(protocol.pack_req(99, 1, addr, 0))
        assert _closed(s)
        # 6. a bad offset is an error reply, touches nothing, and the connection stays usable
        s = _raw(b.port, "t")
        s.sendall(protocol.pack_req(protocol.OP_WRITE, 7, addr + MB - 4, 16) + b"y" * 16)
        magic, status, rid, n = protocol.RESP.unpack(s.recv(protocol.RESP.size, socket.MSG_WAITALL))
        assert (magic, rid) == (protocol.RESP_MAGIC, 7) and status != 0
        assert b"not inside" in s.recv(n, socket.MSG_WAITALL)
        s.sendall(protocol.pack_req(protocol.OP_PING, 8, 0, 0))
        assert protocol.RESP.unpack(s.recv(protocol.RESP.size, socket.MSG_WAITALL))[1:3] == (0, 8)
        s.close()
        assert not dst.any()
        assert b._server.rejected >= 3
        # the listener still serves real transfers
        src = np.full(MB, 3, np.uint8)
        a.register_memory(src)
        seg = a.open_segment(b.name)
        a.write(seg, src.ctypes.data, addr, MB, timeout=5)
        assert (dst == 3).all()


def test_token_listener_rejects_unauthenticated_ops():
    with TransferEngine(token="tok") as b:
        dst = np.zeros(4096, np.uint8)
        b.register_memory(dst)
        s = _raw(b.port)
        s.sendall(protocol.pack_req(protocol.OP_WRITE, 1, dst.ctypes.data, 4) + b"zzzz")
        assert _closed(s)
        assert not dst.any()
        s = _raw(b.port)
        s.sendall(protocol.pack_req(protocol.OP_HELLO, 1, 0, 3) + b"bad")
        magic, status, rid, n = protocol.RESP.unpack(s.recv(protocol.RESP.size, socket.MSG_WAITALL))
        assert status != 0
        assert b"token" in s.recv(n, socket.MSG_WAITALL)
        assert _closed(s)


def test_response_with_wrong_id_is_a_protocol_failure(engine):
    """A peer that answers out of order is treated as broken, not trusted."""
    ls = socket.create_server(("127.0.0.1", 0))
    port = ls.getsockname()[1]
    import threading

    def evil():
        c, _ = ls.accept()
        hdr = c.recv(protocol.REQ.size, socket.MSG_WAITALL)
        rid = struct.unpack_from("<Q", hdr, 8)[0]
        c.sendall(protocol.pack_resp(0, rid + 1000, 0))
        c.recv(1)
        c.close()

    th = threading.Thread(target=evil, daemon=True)
    th.start()
    tcp = engine.transports["tcp"]
    from kvplane.common.deadline import Deadline
    from kvplane.transfer.batch import Batch, Slice

    local = np.zeros(16, np.uint8)
    b = Batch(1, 1)
    (task,) = b.add([TransferRequest(OpCode.WRITE, 0, 0, 0, 16)])
    b.expect(task, 1)
    engine.config  # noqa: B018
    tcp.ctx = type(tcp.ctx)(**{**tcp.ctx.__dict__, "retries": 0})
    tcp._lane(("127.0.0.1", port), [Slice(task, OpCode.WRITE, memoryview(local), 0, 16)],
              Deadline.after(5))
    assert task.status == TransferStatus.FAILED and "response id" in task.error
    ls.close()
    th.join(5)


def test_slice_on_a_cut_connection_is_retried_on_a_fresh_one():
    from kvplane.common import metrics

    with TransferEngine(protocol="tcp", slice_size=MB, streams=1) as a, \
            TransferEngine(protocol="tcp") as b:
        src = np.random.randint(0, 256, 8 * MB, dtype=np.uint8)
        dst = np.zeros_like(src)
        a.register_memory(src)
        b.register_memory(dst)
        seg = a.open_segment(b.name)
        real = b._server._handle
        cuts = []

        def cut_once(conn, op, rid, addr, length, *rest):
            if op == protocol.OP_WRITE and len(cuts) == 0 and b._server.frames >= 3:
                cuts.append(rid)
                conn.shutdown(socket.SHUT_RDWR)  # the connection dies mid-batch
                raise OSError("cut")
            return real(conn, op, rid, addr, length, *rest)

        b._server._handle = cut_once
        retries = metrics.TRANSFER_RETRIES.labels("tcp")._value.get()
        a.write(seg, src.ctypes.data, dst.ctypes.data, src.nbytes, timeout=10)
        assert cuts and np.array_equal(src, dst)
        assert metrics.TRANSFER_RETRIES.labels("tcp")._value.get() == retries + 1


def test_a_peer_that_never_answers_hello_fails_within_the_connect_timeout():
    """A stopped peer's kernel still accepts the connection; its HELLO answer never comes. The
    engine's ``connect_timeout`` (``KVPLANE_CONNECT_TIMEOUT``) bounds that wait, not a fixed
    5 s: vLLM workers on a busy host needed more (a PD pull at TP=2), a fast detector less."""
    with spawn_target("--buf-mb", "1", "--token", "tok-hello") as t, \
            TransferEngine(protocol="tcp", token="tok-hello", connect_timeout=0.5) as te:
        t.signal(signal.SIGSTOP)
        try:
            host, port = t.info["segment"].rsplit(":", 1)
            t0 = time.monotonic()
            with pytest.raises(KVPlaneError, match="timed out"):  # the P2P handshake, once
                te.transports["tcp"].describe((host, int(port)), 20)
            assert time.monotonic() - t0 < 3
        finally:
            t.signal(signal.SIGCONT)
