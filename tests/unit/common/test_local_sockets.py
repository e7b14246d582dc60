"""Same-host Unix sockets (kvplane.common.local): a client of a server on its own host moves to
the server's Unix socket, authenticates there as over TCP, and never moves past a relay or to a
process other than the one that answered over TCP."""

from __future__ import annotations

import os
import socket
import threading

import msgspec
import pytest

from kvplane.common import local
from kvplane.common.errors import Unauthorized
from kvplane.common.rpc import RpcClient, RpcServer
from kvplane.transfer import protocol
from kvplane.transfer.memory import MemoryTable, Region, view_at
from kvplane.transfer.server import DataServer
from kvplane.transfer.transports.tcp_conn import Conn

pytestmark = pytest.mark.timeout(30)


class Req(msgspec.Struct):
    x: int


def rpc_server(token: str = "t") -> RpcServer:
    srv = RpcServer(token=token)
    srv.add("double", lambda r: r.x * 2, Req)
    return srv.start()


class Relay:
    """A TCP relay on 127.0.0.1 in front of ``port`` (what fault tests and sidecars put there)."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.bytes = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.lsock.accept()
            except OSError:
                return
            b = socket.create_connection(("127.0.0.1", self.target))
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self.bytes += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.lsock.close()


def test_rpc_client_moves_to_the_unix_socket_and_authenticates_there():
    with rpc_server() as srv:
        assert srv.local_name
        with RpcClient(f"127.0.0.1:{srv.port}", token="t") as c:
            assert c.call("double", Req(21), int) == 42
            assert c.transport == "unix"
            assert c.call("double", Req(2), int) == 4
        with RpcClient(f"127.0.0.1:{srv.port}", token="bad") as c, pytest.raises(Unauthorized):
            c.call("double", Req(1), int)
        # the Unix socket itself asks for the token, as the TCP port does
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect("\0" + srv.local_name)
            from kvplane.common import wire

            env = wire.Envelope(wire.WIRE_VERSION, 1, "double", "bad", 1000,
                                msgspec.Raw(wire.encode(Req(1))))
            body = wire.encode(env)
            s.sendall(len(body).to_bytes(4, "little") + body)
            got = b""
            try:
                while chunk := s.recv(4096):
                    got += chunk
            except ConnectionResetError:
                pass
            reply = wire.decode(memoryview(got)[4:], wire.Reply) if len(got) > 4 else None
            assert reply is None or reply.code == Unauthorized.code


def test_rpc_client_stays_behind_a_relay():
    with rpc_server() as srv:
        relay = Relay(srv.port)
        try:
            with RpcClient(f"127.0.0.1:{relay.port}", token="t") as c:
                before = relay.bytes
                assert c.call("double", Req(5), int) == 10
                assert c.transport == "tcp"
                assert relay.bytes > before  # the call went through the relay
        finally:
            relay.close()


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("KVPLANE_LOCAL_SOCKETS", "0")
    with rpc_server() as srv:
        assert srv.local_name == ""
        with RpcClient(f"127.0.0.1:{srv.port}", token="t") as c:
            assert c.call("double", Req(1), int) == 2
            assert c.transport == "tcp"


def test_connect_checks_the_pid_and_the_peer_address():
    bound = local.bind()
    assert bound is not None
    lsock, name = bound
    lsock.listen(4)
    tcp_srv = socket.create_server(("127.0.0.1", 0))
    tcp = socket.create_connection(tcp_srv.getsockname())
    try:
        me = local.address(tcp.getsockname())
        ok = local.connect(local.LocalInfo(name, os.getpid(), me), tcp, 2.0)
        assert ok is not None
        ok.close()
        # a name held by another process than the one that answered: refused
        assert local.connect(local.LocalInfo(name, os.getpid() + 1, me), tcp, 2.0) is None
        # the server saw another peer address (a relay between us): refused
        assert local.connect(local.LocalInfo(name, os.getpid(), "127.0.0.1:1"), tcp, 2.0) is None
        # no such name
        assert local.connect(local.LocalInfo(name + "x", os.getpid(), me), tcp, 2.0) is None
    finally:
        for s in (tcp, tcp_srv, lsock):
            s.close()


@pytest.fixture
def data_server():
    buf = bytearray(os.urandom(1 << 16))
    mem = MemoryTable()
    holder = (ctypes_addr(buf), buf)
    mem.add(Region(holder[0], len(buf), view_at(holder[0], len(buf)), keep=buf))
    srv = DataServer(mem, lambda: b"desc", token="tok")
    yield srv, holder
    srv.close()


def ctypes_addr(buf: bytearray) -> int:
    import ctypes

    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


def _read(conn: Conn, addr: int, n: int) -> bytes:
    rid = conn.next_id()
    conn.sock.sendall(protocol.pack_req(protocol.OP_READ, rid, addr, n, 0))
    view = memoryview(bytearray(n))
    codes, _ = conn.receive_one(rid, view)
    assert codes[0] == 0
    return bytes(view)


def test_data_connection_moves_and_reads_the_same_bytes(data_server):
    srv, (addr, buf) = data_server
    conn = Conn.open("127.0.0.1", srv.port, "tok", 5.0)
    try:
        assert conn.sock.family == socket.AF_UNIX
        assert _read(conn, addr + 100, 4096) == bytes(buf[100:4196])
    finally:
        conn.close()
    with pytest.raises(Unauthorized):
        Conn.open("127.0.0.1", srv.port, "wrong", 5.0)


def test_data_connection_stays_behind_a_relay(data_server):
    srv, (addr, buf) = data_server
    relay = Relay(srv.port)
    conn = Conn.open("127.0.0.1", relay.port, "tok", 5.0)
    try:
        assert conn.sock.family == socket.AF_INET
        before = relay.bytes
        assert _read(conn, addr, 1024) == bytes(buf[:1024])
        assert relay.bytes > before
    finally:
        conn.close()
        relay.close()


def test_data_connection_sends_hello_and_local_in_one_round_trip():
    """The client sends OP_LOCAL behind its HELLO without waiting for HELLO's answer: a peer
    that answers nothing until it has both frames still gets both (a client that waited would
    never send the second)."""
    lsock = socket.create_server(("127.0.0.1", 0))
    token = b"tok"
    want = 2 * protocol.REQ.size + len(token)
    got = bytearray()
    both = threading.Event()

    def serve() -> None:
        conn, _ = lsock.accept()
        with conn:
            conn.settimeout(10)
            while len(got) < want:
                chunk = conn.recv(want - len(got))
                if not chunk:
                    return
                got.extend(chunk)
            both.set()
            _, _, op1, _, rid1, _, n1, _ = protocol.REQ.unpack_from(got, 0)
            _, _, op2, _, rid2, _, _, _ = protocol.REQ.unpack_from(got, protocol.REQ.size + n1)
            assert (op1, op2) == (protocol.OP_HELLO, protocol.OP_LOCAL)
            info = msgspec.msgpack.encode(local.LocalInfo("", os.getpid(), ""))  # none offered
            conn.sendall(protocol.pack_resp(0, rid1, 0) + protocol.pack_resp(0, rid2, len(info))
                         + info)
            conn.recv(1)  # until the client closes

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        conn = Conn.open("127.0.0.1", lsock.getsockname()[1], token.decode(), 5.0)
        assert both.is_set() and conn.sock.family == socket.AF_INET  # no name: stays on TCP
        conn.close()
    finally:
        lsock.close()
        t.join(10)


def test_a_refused_token_does_not_keep_a_peer_off_its_unix_socket(data_server):
    srv, (addr, buf) = data_server
    for _ in range(2):
        with pytest.raises(Unauthorized):
            Conn.open("127.0.0.1", srv.port, "wrong", 5.0)
    conn = Conn.open("127.0.0.1", srv.port, "tok", 5.0)
    try:
        assert conn.sock.family == socket.AF_UNIX
        assert _read(conn, addr, 512) == bytes(buf[:512])
    finally:
        conn.close()
