"""Issue 15, findings 8, 9 and 15 (log spam): what a peer can do before it authenticates.

8: a claimed frame size is never allocated before the token is checked.
9: idle and half-open connections time out and cannot lock real clients out (RPC, data port,
   HTTP); authenticated idle connections time out too, and clients reconnect by themselves.
15: junk connections cost one log line per peer, a truncated HTTP request no traceback.
"""

from __future__ import annotations

import logging
import socket
import struct
import time

import httpx
import msgspec
import numpy as np
import pytest

from kvplane.common.guard import Limits
from kvplane.common.rpc import RpcClient, RpcServer
from kvplane.transfer import TransferEngine
from kvplane.transfer.metadata_server import serve_in_thread
from tests.support.hostile import raise_nofile
from tests.support.services import wait_until

pytestmark = [pytest.mark.fault, pytest.mark.timeout(120)]


class Req(msgspec.Struct):
    x: int


@pytest.fixture(autouse=True, scope="module")
def _fds():
    raise_nofile(8192)


def rpc_server(**limits) -> RpcServer:
    srv = RpcServer(token="t", limits=Limits(**limits) if limits else None)
    srv.add("double", lambda r: r.x * 2, Req)
    return srv


def closed_within(s: socket.socket, seconds: float) -> bool:
    """True if the server closes ``s`` within ``seconds`` (we never send more)."""
    s.settimeout(seconds)
    try:
        while s.recv(65536):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    finally:
        s.close()


def test_claimed_16mib_frame_is_refused_before_any_allocation():
    with rpc_server() as srv:
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        s.sendall(struct.pack("<I", 16 << 20) + b"\0" * 1024)  # and never the rest
        assert closed_within(s, 3), "the server waited for a 16 MiB body from a stranger"
        assert srv.malformed == 1
        with RpcClient(f"127.0.0.1:{srv.port}", token="t") as c:
            assert c.call("double", Req(4), int) == 8


def test_large_first_request_of_a_real_client_still_works():
    """A client whose first request is over the pre-auth limit authenticates first (rpc.hello)."""
    with rpc_server() as srv:
        srv.add("echo", lambda r: r, list[str])
        with RpcClient(f"127.0.0.1:{srv.port}", token="t") as c:
            big = ["k" * 100] * 2000  # ~200 KiB
            assert c.call("echo", big, list[str]) == big


def test_idle_sockets_cannot_lock_out_rpc_clients():
    with rpc_server() as srv:
        idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=5) for _ in range(1100)]
        try:
            with RpcClient(f"127.0.0.1:{srv.port}", token="t", timeout=5) as c:
                assert c.call("double", Req(21), int) == 42
            pre, authed = srv.admission.counts()
            assert pre <= Limits().max_preauth_per_peer  # the oldest idle ones were closed
        finally:
            for s in idle:
                s.close()


def test_unauthenticated_connections_time_out():
    with rpc_server(handshake_timeout=0.5) as srv:
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        t0 = time.monotonic()
        assert closed_within(s, 5)
        assert 0.3 < time.monotonic() - t0 < 4
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        s.sendall(struct.pack("<I", 100) + b"\0" * 10)  # a slow first frame: same deadline
        assert closed_within(s, 5)


def test_idle_authenticated_connection_times_out_and_the_client_reconnects():
    with rpc_server(idle_timeout=2) as srv:
        with RpcClient(f"127.0.0.1:{srv.port}", token="t", timeout=5) as c:
            assert c.call("double", Req(1), int) == 2
            wait_until(lambda: srv.admission.counts() == (0, 0), 10, "idle close")
            assert c.call("double", Req(2), int) == 4  # a fresh connection, no error


def test_idle_sockets_cannot_lock_out_the_data_port(monkeypatch):
    monkeypatch.setenv("KVPLANE_HANDSHAKE_TIMEOUT", "30")
    with TransferEngine(protocol="tcp", token="t") as b, TransferEngine(protocol="tcp", token="t") as a:
        dst = np.zeros(4096, np.uint8)
        b.register_memory(dst)
        idle = [socket.create_connection(("127.0.0.1", b.port), timeout=5) for _ in range(600)]
        try:
            src = np.full(4096, 7, np.uint8)
            a.register_memory(src)
            seg = a.open_segment(b.name)
            a.write(seg, src.ctypes.data, dst.ctypes.data, 4096, timeout=5)
            assert (dst == 7).all()
        finally:
            for s in idle:
                s.close()


def test_data_port_handshake_timeout(monkeypatch):
    monkeypatch.setenv("KVPLANE_HANDSHAKE_TIMEOUT", "0.5")
    with TransferEngine(protocol="tcp", token="t") as b:
        s = socket.create_connection(("127.0.0.1", b.port), timeout=5)
        assert closed_within(s, 5)


def test_partial_http_requests_do_not_starve_the_metadata_server():
    with serve_in_thread(token="t") as srv:
        hdr = {"X-KVPlane-Token": "t"}
        assert httpx.put(f"{srv.url}/metadata", params={"key": "k"}, content=b"v",
                         headers=hdr).status_code == 200
        partial = []
        try:
            for _ in range(1100):  # slowloris: headers that never end
                s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
                s.sendall(b"GET /metadata?key=k HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                partial.append(s)
            r = httpx.get(f"{srv.url}/metadata", params={"key": "k"}, headers=hdr, timeout=10)
            assert r.status_code == 200 and r.content == b"v"
        finally:
            for s in partial:
                s.close()


def test_slow_http_request_is_cut_at_the_handshake_timeout(monkeypatch):
    monkeypatch.setenv("KVPLANE_HANDSHAKE_TIMEOUT", "0.5")
    with serve_in_thread(token="t") as srv:
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        s.sendall(b"GET /health HTTP/1.1\r\n")
        assert closed_within(s, 5)


def _warnings(caplog, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith(name) and r.levelno >= logging.WARNING]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_junk_connections_cost_one_log_line_per_peer(caplog):
    caplog.set_level(logging.INFO)
    with TransferEngine(protocol="tcp", token="t") as te, rpc_server() as srv, \
            serve_in_thread(token="t") as http:
        uv = _Records()
        logging.getLogger("uvicorn").addHandler(uv)
        for port in (te.port, srv.port, http.port):
            for _ in range(1000):
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(b"\xde\xad\xbe\xef" * 16)
                s.close()
        wait_until(lambda: len(te._server._conns) == 0, 10, "data connections drained")
        logging.getLogger("uvicorn").removeHandler(uv)
    assert len(_warnings(caplog, "kvplane.transfer")) <= 2
    assert len(_warnings(caplog, "kvplane.common.rpc")) <= 2
    assert len(_warnings(caplog, "kvplane.common")) <= 6
    assert not [r for r in uv.records if r.levelno >= logging.WARNING]


def test_truncated_metadata_put_logs_no_traceback(caplog):
    caplog.set_level(logging.INFO)
    with serve_in_thread(token="t") as srv:
        # uvicorn's loggers do not propagate to the root (caplog): watch them directly
        uv = _Records()
        logging.getLogger("uvicorn.error").addHandler(uv)
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
            s.sendall(b"PUT /metadata?key=a HTTP/1.1\r\nHost: x\r\nX-KVPlane-Token: t\r\n"
                      b"Content-Length: 1000\r\n\r\n" + b"x" * 10)
            s.close()
        assert httpx.get(f"{srv.url}/health").status_code == 200
        wait_until(lambda: any("went away" in r.getMessage() for r in caplog.records), 10,
                   "the disconnect to be noticed")
        logging.getLogger("uvicorn.error").removeHandler(uv)
    every = caplog.records + uv.records
    assert not [r for r in every if r.exc_info], "a traceback was logged"
    assert not [r for r in every if r.levelno >= logging.ERROR]
    assert len([r for r in every if r.levelno >= logging.WARNING]) <= 2
