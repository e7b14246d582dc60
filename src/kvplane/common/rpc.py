"""Control-plane RPC: length-prefixed msgpack frames over plain TCP, one thread per connection.

Why not ZeroMQ here: on this class of machine a pyzmq DEALER/ROUTER round trip measured
~93 us against ~26 us for a blocking TCP socket (the libzmq I/O threads add four thread hops
per call), and the store's small-object latency is mostly master round trips. pyzmq stays the
transport for KV events (PUB/SUB), where its fan-out and replay sockets are what we need.

Every call carries a request id, a timeout and the token; errors travel as numeric codes
(``kvplane.common.errors``) and are raised again on the client. A connection authenticates with
its first frame, which must arrive within the handshake timeout and be at most
``preauth_frame`` bytes (``kvplane.common.guard``); a client whose first request is larger
sends a small ``rpc.hello`` first. The token is resolved once per connection; handlers read the
caller's :class:`~kvplane.common.auth.Principal` with :func:`current_principal`. Later frames
are limited to ``max_message`` bytes, and their buffers grow as bytes arrive, never to a size
the peer merely claims. A malformed frame closes that connection only; bad peers are logged
once per peer at a time.
"""

from __future__ import annotations

import itertools
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import msgspec

from kvplane.common import local, wire
from kvplane.common.auth import ADMIN, Authenticator, Principal, token_authenticator
from kvplane.common.errors import (
    InvalidArgument,
    KVPlaneError,
    ProtocolError,
    Timeout,
    Unauthorized,
    Unavailable,
    from_code,
)
from kvplane.common.guard import REJECTED, Limits, PeerLog
from kvplane.common.listener import Listener
from kvplane.common.sockets import SPIN_SECONDS, poll_spin, recv_exact, set_io_timeout

log = logging.getLogger(__name__)
T = TypeVar("T")
Handler = Callable[[Any], Any]
_LEN = struct.Struct("<I")


_CHUNK = 1 << 20
_READ_AHEAD = 64 << 10  # bytes a server connection reads at once (a request, and any after it)


class OversizedFrame(ProtocolError):
    """A frame's length prefix is over the limit; ``head`` is those four bytes as received."""

    def __init__(self, message: str, head: bytes) -> None:
        super().__init__(message)
        self.head = head


class NotRpcPeer(ProtocolError):
    """The peer answered, but not as a kvplane RPC server (an HTTP or ZMQ port, say): never
    retried, since asking again cannot change what listens there."""


def _what_answered(endpoint: str, head: bytes) -> NotRpcPeer | None:
    """The error for a reply that begins with ``head`` (text, where an RPC frame's length was
    expected), or None when the four bytes could be a length."""
    if head.startswith(b"HTTP"):
        what = ("HTTP: an admin, metadata, conductor or router port? The master's RPC port is "
                "its --port (50051 by default; \"master\" in its ready line)")
    elif all(32 <= b < 127 for b in head):
        what = f"{head.decode()!r}...: another protocol"
    else:
        return None
    return NotRpcPeer(f"{endpoint} is not a kvplane RPC port: it answered {what}")


def _recv_frame(sock: socket.socket, limit: int, spin: float = SPIN_SECONDS,
                spinner: threading.Lock | None = None) -> bytearray:
    """One length-prefixed frame. Its head is first busy-polled for ``spin`` seconds (with
    ``spinner``: only if that lock is free, held while polling, never while blocked)."""
    head = memoryview(bytearray(4))
    got = 0
    if spin > 0 and (spinner is None or spinner.acquire(blocking=False)):
        try:
            got = poll_spin(sock, head, spin)
        finally:
            if spinner is not None:
                spinner.release()
        if got == 0:
            raise Unavailable("connection closed")
        got = max(got, 0)
    recv_exact(sock, head[got:])
    (n,) = _LEN.unpack(head)
    if n > limit:
        raise OversizedFrame(f"frame of {n} bytes exceeds {limit}", bytes(head))
    return _recv_body(sock, n)


def _recv_body(sock: socket.socket, n: int, part: bytes | memoryview = b"") -> bytearray:
    """The ``n`` bytes of a frame's body, of which ``part`` arrived already."""
    if n <= _CHUNK:
        body = bytearray(n)
        body[:len(part)] = part
        recv_exact(sock, memoryview(body)[len(part):])
        return body
    body = bytearray(part)  # large: grow with what arrives, not with what the peer claims
    while len(body) < n:
        more = bytearray(min(_CHUNK, n - len(body)))
        recv_exact(sock, memoryview(more))
        body += more
    return body


class _Frames:
    """The request frames of one server connection, read ahead: one ``recv`` usually brings a
    whole request (and any the peer pipelined after it), where reading the head and then the
    body took two. A frame is returned as a view of the read-ahead buffer, valid until the next
    call; one larger than the buffer is read into its own (``_recv_body``).

    Raises (from :meth:`next`): ProtocolError (a frame over ``limit``), Unavailable (closed),
    TimeoutError (the socket's kernel timeout: nothing arrived).
    """

    __slots__ = ("sock", "limit", "buf", "view", "start", "end")

    def __init__(self, sock: socket.socket, limit: int) -> None:
        self.sock, self.limit = sock, limit
        self.buf = bytearray(_READ_AHEAD)
        self.view = memoryview(self.buf)
        self.start = self.end = 0

    def buffered(self) -> bool:
        """Whether bytes of a next frame are here already (no need to wait, or to poll)."""
        return self.end > self.start

    def poll(self, spin: float) -> bool:
        """Busy-poll for up to ``spin`` seconds for more bytes; True if some came."""
        self._compact()
        got = poll_spin(self.sock, self.view[self.end:], spin)
        if got == 0:
            raise Unavailable("connection closed")
        if got < 0:
            return False
        self.end += got
        return True

    def next(self) -> memoryview | bytearray:
        """The next frame's body."""
        while True:
            have = self.end - self.start
            if have >= 4:
                (n,) = _LEN.unpack_from(self.buf, self.start)
                if n > self.limit:
                    raise ProtocolError(f"frame of {n} bytes exceeds {self.limit}")
                if n + 4 <= have:
                    at = self.start + 4
                    self.start = at + n
                    return self.view[at:at + n]
                if n + 4 > len(self.buf):  # will not fit: its own buffer
                    part = self.view[self.start + 4:self.end]
                    self.start = self.end = 0
                    return _recv_body(self.sock, n, part)
            self._compact()
            try:
                k = self.sock.recv_into(self.view[self.end:])
            except BlockingIOError as exc:
                raise TimeoutError("receive timed out") from exc
            if k == 0:
                raise Unavailable("connection closed by peer")
            self.end += k

    def _compact(self) -> None:
        """Move what is left of the buffer to its front."""
        if self.start:
            have = self.end - self.start
            if have:
                self.buf[:have] = bytes(self.view[self.start:self.end])  # (may overlap)
            self.start, self.end = 0, have


def _recv_first(sock: socket.socket, limit: int, timeout: float) -> bytearray:
    """The first frame of a connection: at most ``limit`` bytes, all of it within ``timeout``.

    Raises:
        ProtocolError: the frame is larger than ``limit``.
        TimeoutError: it did not arrive in time.
    """
    deadline = time.monotonic() + timeout
    head = bytearray(4)
    _recv_by(sock, memoryview(head), deadline)
    (n,) = _LEN.unpack(head)
    if n > limit:
        raise ProtocolError(f"first frame of {n} bytes exceeds {limit} before authentication")
    body = bytearray(n)
    _recv_by(sock, memoryview(body), deadline)
    return body


def _recv_by(sock: socket.socket, view: memoryview, deadline: float) -> None:
    got = 0
    while got < len(view):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("handshake timed out")
        set_io_timeout(sock, left)
        try:
            k = sock.recv_into(view[got:])
        except BlockingIOError as exc:
            raise TimeoutError("handshake timed out") from exc
        if k == 0:
            raise Unavailable("connection closed by peer")
        got += k


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    try:
        sock.sendall(_LEN.pack(len(payload)) + payload)
    except BlockingIOError as exc:
        raise TimeoutError("rpc send timed out") from exc


_NONE = msgspec.Raw(wire.encode(None))
_ENC = msgspec.msgpack.Encoder()
_ENVELOPE = msgspec.msgpack.Decoder(wire.Envelope)
HELLO = "rpc.hello"  # a no-op call a client makes to authenticate before a large first request
LOCAL = "rpc.local"  # "your same-host Unix socket?": a local.LocalInfo (kvplane.common.local)
_PREAUTH_SAFE = 48 << 10  # a first request larger than this is preceded by HELLO
_STALE_AFTER = 1.0  # a connection idle this long is checked for a server-side close before use
_current = threading.local()


def after_reply(fn: Callable[[], None]) -> None:
    """Run ``fn`` on this thread once the answer of the RPC being served has been sent: work
    its caller need not wait for, and may go without. It is dropped when the answer is not
    sent (a broken connection), and outside an RPC server's thread (a handler called
    directly, which may hold the locks ``fn`` takes). An exception it raises is logged."""
    later = getattr(_current, "after", None)
    if later is not None:
        later.append(fn)


def _run_after(fns: list[Callable[[], None]]) -> None:
    """Run and remove each of ``fns`` (a list that one more may be added to meanwhile)."""
    while fns:
        fn = fns.pop(0)
        try:
            fn()
        except Exception:  # a bug in deferred work must not drop the connection
            log.exception("work after an RPC's answer failed")


def current_principal() -> Principal:
    """The principal of the RPC being served on this thread (the admin outside any RPC)."""
    return getattr(_current, "principal", None) or ADMIN


def dispatch(handlers: Mapping[str, tuple[Handler, type[Any]]], token: str | Authenticator,
             data: bytes | bytearray | memoryview) -> wire.Reply | None:
    """Serve one request frame: decode it, check version and token, run the method's handler.

    ``token`` is the shared token ("" accepts anyone) or an authenticator (token -> principal,
    None rejects). The handler runs with :func:`current_principal` set. Errors the handler
    raises from the kvplane tree travel back as their code; any other exception is a handler
    bug, logged and answered with the root code.

    Returns:
        The reply to send, or None when ``data`` is not an envelope at all (the caller drops
        the connection and counts it as malformed).
    """
    env = _envelope(data)
    if env is None:
        return None
    ok, out = _call(handlers, token_authenticator(token) if isinstance(token, str) else token,
                    env)
    return wire.Reply(env.id, 0, "", msgspec.Raw(wire.encode(out))) if ok else out


def answer(handlers: Mapping[str, tuple[Handler, type[Any]]], check: Authenticator,
           data: bytes | bytearray | memoryview, out: bytearray) -> bool:
    """:func:`dispatch`, its reply framed into ``out`` (resized to the frame: the 4-byte
    length, then the reply's msgpack, byte for byte what ``wire.encode(dispatch(...))``
    gives). A success is encoded once, straight into ``out``, where ``dispatch`` encodes the
    handler's answer and then the envelope around a copy of it.

    Returns:
        False when ``data`` is not an envelope (nothing is written).
    """
    env = _envelope(data)
    if env is None:
        return False
    ok, rep = _call(handlers, check, env)
    if ok:  # Reply(id, 0, "", body) as msgspec writes it: fixarray 4, id, 0, "", body
        head = b"\x94" + _ENC.encode(env.id) + b"\x00\xa0"
        at = 4 + len(head)
        _ENC.encode_into(rep, out, at)
        out[4:at] = head
    else:
        _ENC.encode_into(rep, out, 4)
    _LEN.pack_into(out, 0, len(out) - 4)
    return True


def _envelope(data: bytes | bytearray | memoryview) -> wire.Envelope | None:
    try:
        return _ENVELOPE.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _call(handlers: Mapping[str, tuple[Handler, type[Any]]], check: Authenticator,
          env: wire.Envelope) -> tuple[bool, Any]:
    """Run ``env``'s method: (True, the handler's answer) or (False, the error ``Reply``)."""
    try:
        if env.v != wire.WIRE_VERSION:
            raise ProtocolError(f"wire version {env.v} not supported")
        principal = check(env.token)
        if principal is None:
            raise Unauthorized("bad or missing token")
        if env.method == HELLO:
            return True, None
        entry = handlers.get(env.method)
        if entry is None:
            raise InvalidArgument(f"unknown method {env.method!r}")
        handler, rtype = entry
        _current.principal = principal
        try:
            return True, handler(wire.decode(env.body, rtype))
        finally:
            _current.principal = None
    except KVPlaneError as exc:
        return False, wire.Reply(env.id, exc.code, str(exc), _NONE)
    except Exception as exc:  # a handler bug must not kill the server
        log.exception("rpc handler %s failed", env.method)
        return False, wire.Reply(env.id, KVPlaneError.code, f"internal error: {exc}", _NONE)


class _Session:
    """Per-connection authenticator: the first accepted token is remembered (checked once)."""

    def __init__(self, check: Authenticator) -> None:
        self._check = check
        self.token: str | None = None
        self.principal: Principal | None = None

    def __call__(self, given: str) -> Principal | None:
        if self.principal is not None and given == self.token:
            return self.principal
        found = self._check(given)
        if found is not None and self.principal is None:
            self.token, self.principal = given, found
        return found


class RpcServer:
    """Serves registered methods over TCP; handlers run on the connection's thread.

    The port is bound once constructed; register methods with ``add`` before handing the
    address out. With ``listen=False`` it is not listening (a connect is refused, and clients
    retry) until :meth:`start`, so a server that adds its methods after construction never
    answers "unknown method" to a client that came early.

    Args:
        host: bind address (127.0.0.1 unless told otherwise).
        port: TCP port, 0 picks a free one (read it back from ``.port``).
        token: shared token; empty disables the check (unless ``authenticate`` is given).
        max_message: largest request accepted from an authenticated peer, in bytes.
        max_connections: inbound connections beyond this are refused.
        authenticate: token -> principal (None rejects); replaces ``token`` when given.
        limits: pre-authentication limits (default: from the environment).
        spin: seconds a connection whose peer sent its next request within that long of the
            last answer (a client in a tight loop) is busy-polled for the next one, one
            connection at a time; 0 (the default) never. It saves the wake-up of a sleeping
            thread when a core is idle, and costs a core while it polls: on a host whose
            cores are all busy (the store master beside its clients and segments on two
            cores) it slows them (docs/benchmarks.md, "Issue 32: the master's RPC path").
        listen: accept from construction on (default); False: only from :meth:`start`.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str = "",
                 max_message: int = wire.MAX_CONTROL_FRAME, max_connections: int = 1024,
                 authenticate: Authenticator | None = None, limits: Limits | None = None,
                 spin: float = 0.0, listen: bool = True) -> None:
        self._auth = authenticate or token_authenticator(token)
        self._max = max_message
        self._handlers: dict[str, tuple[Handler, type[Any]]] = {}
        self.malformed = 0
        self.peer_log = PeerLog(log)
        if limits is None:
            limits = Limits.from_env(max_connections=max_connections)
        self._listener = Listener(self._serve, host, port, "rpc", limits.max_connections,
                                  lambda: self.peer_log.warn("*", "refused a connection: "
                                                             "%d connections held",
                                                             limits.max_connections),
                                  limits=limits, listen=listen, local=True)
        self.host, self.port = self._listener.host, self._listener.port
        self.admission = self._listener.admission
        self._spin = spin
        self._spinner = threading.Lock()  # held by the one connection busy-polling, if any
        self._handlers[LOCAL] = (self._local, object)

    @property
    def local_name(self) -> str:
        """The abstract Unix socket same-host clients move to ("" when none is offered)."""
        return self._listener.local_name

    def _local(self, _request: object) -> local.LocalInfo:
        """``rpc.local``: where a client on this host may reconnect (kvplane.common.local)."""
        conn = getattr(_current, "conn", None)
        if conn is None:
            return local.LocalInfo("", 0, "")
        return local.info_for(self._listener.local_name, conn)

    def add(self, method: str, handler: Handler, request_type: type[Any]) -> None:
        """Register ``handler(request) -> reply`` for ``method``."""
        self._handlers[method] = (handler, request_type)

    def start(self) -> RpcServer:
        """Open the port (built with ``listen=False``: once every handler is added); with the
        default ``listen=True`` the listener is accepting already."""
        self._listener.start()
        return self

    def _serve(self, conn: socket.socket) -> None:
        _current.conn = conn
        later: list[Callable[[], None]] = []  # (``after_reply``; dropped with an unsent answer)
        _current.after = later
        session = _Session(self._auth)
        out = bytearray()  # the reply being sent (reused: one buffer per connection)
        try:
            if not self._handshake(conn, session, out):
                return
            if later:
                _run_after(later)
            set_io_timeout(conn, self._listener.limits.idle_timeout or 1e9)
            frames = _Frames(conn, self._max)
            quick, done_at, spin = False, 0.0, self._spin
            while not self._listener.closed.is_set():
                try:  # a peer in a tight loop is busy-polled (``_spin``), one at a time
                    if quick and not frames.buffered() and self._spinner.acquire(blocking=False):
                        try:
                            frames.poll(spin)
                        finally:
                            self._spinner.release()
                    data = frames.next()
                    if spin:
                        quick = time.perf_counter() - done_at < spin
                except ProtocolError as exc:
                    self._reject(conn, "malformed", str(exc))
                    return
                except TimeoutError:
                    REJECTED.labels("rpc", "idle").inc()
                    return
                if not self._answer(conn, session, data, out):
                    return
                if later:  # work a handler left for after its answer (``after_reply``)
                    _run_after(later)
                if len(out) > _READ_AHEAD:  # a large answer: do not hold its buffer
                    out = bytearray()
                if spin:
                    done_at = time.perf_counter()
        except (OSError, KVPlaneError):
            pass
        finally:
            _current.conn = _current.after = None  # (the thread may be kept for another one)

    def _handshake(self, conn: socket.socket, session: _Session, out: bytearray) -> bool:
        """Read, check and answer the first frame; True once the peer is authenticated."""
        lim = self._listener.limits
        try:
            data = _recv_first(conn, lim.preauth_frame, lim.handshake_timeout)
        except ProtocolError as exc:
            self._reject(conn, "oversized_unauthenticated", str(exc))
            return False
        except TimeoutError:
            self._reject(conn, "handshake_timeout", "no complete first frame within "
                         f"{lim.handshake_timeout}s")
            return False
        if not self._answer(conn, session, data, out):
            return False
        if session.principal is None:
            self._reject(conn, "bad_token", "bad or missing token")
            return False
        self._listener.authenticated(conn)
        return True

    def _answer(self, conn: socket.socket, session: _Session,
                data: bytearray | memoryview, out: bytearray) -> bool:
        if not answer(self._handlers, session, data, out):
            self._reject(conn, "malformed", "not an RPC envelope")
            return False
        try:
            conn.sendall(out)
        except BlockingIOError as exc:
            raise TimeoutError("rpc send timed out") from exc
        return True

    def _reject(self, conn: socket.socket, reason: str, detail: str) -> None:
        if reason.startswith(("malformed", "oversized")):
            self.malformed += 1
        REJECTED.labels("rpc", reason).inc()
        self.peer_log.warn(self._listener.peer(conn), "closing RPC connection (%s): %s",
                           reason, detail)

    def close(self) -> None:
        """Stop serving and drop every connection (idempotent)."""
        self._listener.close()

    def __enter__(self) -> RpcServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class RpcClient:
    """A blocking client over one TCP connection. Thread-safe (calls are serialised).

    A call that fails or times out drops the connection, so a late reply can never be taken
    for the answer to a later call; the next call reconnects. ``spin``: seconds to busy-poll
    for each reply before sleeping in the kernel (0: sleep at once).
    """

    def __init__(self, endpoint: str, token: str = "", timeout: float = 10.0,
                 max_message: int = wire.MAX_CONTROL_FRAME, spin: float = SPIN_SECONDS) -> None:
        from kvplane.common.config import parse_hostport

        self.endpoint = endpoint.removeprefix("tcp://")
        self._addr = parse_hostport(self.endpoint)
        self._token = token
        self._timeout = timeout
        self._max = max_message
        self._spin = spin
        self._sock: socket.socket | None = None
        self._armed = -1.0
        self._used = 0.0
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._tcp_only = False  # the server does not offer a same-host Unix socket
        self.transport = "tcp"  # of the connection in use: "tcp" or "unix"

    def _socket(self, timeout: float, first: int, now: float) -> socket.socket:
        """The connection, (re)opened if needed; ``first`` is the size of the next frame."""
        if self._sock is not None and now - self._used > _STALE_AFTER:
            self._drop_if_closed()
        if self._sock is None:
            try:
                s = socket.create_connection(self._addr, timeout=min(timeout, 5.0))
            except OSError as exc:
                raise Unavailable(f"cannot reach {self.endpoint}: {exc}") from exc
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.settimeout(None)
            self._sock, self._armed, self.transport = s, -1.0, "tcp"
            if first > _PREAUTH_SAFE:  # the server reads little before we authenticate
                self._exchange(s, timeout, HELLO, None)
            if not self._tcp_only and local.same_host(s):
                self._go_local(s, timeout, first)
        if timeout != self._armed:
            set_io_timeout(self._sock, timeout)
            self._armed = timeout
        return self._sock

    def _go_local(self, tcp: socket.socket, timeout: float, first: int) -> None:
        """Move a new connection to the server's same-host Unix socket, if it offers one and
        the connection is direct (:mod:`kvplane.common.local`); else keep ``tcp``."""
        rep = self._exchange(tcp, timeout, LOCAL, None)
        if rep.code == InvalidArgument.code:  # a server without rpc.local: ask no more
            self._tcp_only = True
            return
        if rep.code:  # refused (the token): as the call itself would have been
            raise from_code(rep.code, rep.error)
        unix = local.connect(wire.decode(rep.body, local.LocalInfo), tcp, timeout)
        if unix is None:
            return
        self._sock, self._armed, self.transport = unix, -1.0, "unix"
        tcp.close()
        if first > _PREAUTH_SAFE:
            self._exchange(unix, timeout, HELLO, None)

    def _drop_if_closed(self) -> None:
        """Forget a pooled connection the server closed while it was idle (idle timeout)."""
        assert self._sock is not None
        try:
            self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return  # alive and quiet
        except OSError:
            pass
        self._reset()  # closed (b""), reset, or unsolicited bytes: the stream is out of step

    def _exchange(self, sock: socket.socket, timeout: float, method: str, request: Any,
                  meanwhile: Callable[[], None] | None = None) -> wire.Reply:
        if timeout != self._armed:
            set_io_timeout(sock, timeout)
            self._armed = timeout
        rid = next(self._ids)
        env = wire.Envelope(wire.WIRE_VERSION, rid, method, self._token, int(timeout * 1000),
                            msgspec.Raw(wire.encode(request)))
        _send_frame(sock, wire.encode(env))
        if meanwhile is not None:
            meanwhile()
        try:
            frame = _recv_frame(sock, self._max, self._spin)
        except OversizedFrame as exc:
            peer = _what_answered(self.endpoint, exc.head)
            if peer is None:
                raise
            raise peer from exc
        rep = wire.decode(memoryview(frame), wire.Reply)
        if rep.id != rid:
            raise ProtocolError(f"reply id {rep.id} != request id {rid}")
        if rep.code and method == HELLO:
            raise from_code(rep.code, rep.error)
        return rep

    def call(self, method: str, request: Any, reply_type: type[T], timeout: float | None = None,
             meanwhile: Callable[[], None] | None = None) -> T:
        """Call ``method`` and decode the reply as ``reply_type``.

        ``meanwhile`` runs once the request is sent, before the reply is read (the store's
        client reads the bytes it speculates on while the master answers). It must not raise
        and must not use this client.

        Raises:
            Timeout: no reply within ``timeout`` (default: the client's).
            Unavailable: the server cannot be reached or dropped the connection.
            NotRpcPeer: something else listens there (an HTTP port, say); not retried.
            KVPlaneError: the server's error, re-raised by code.
        """
        t = self._timeout if timeout is None else timeout
        body = wire.encode(request)
        with self._lock:
            now = time.monotonic()
            try:
                sock = self._socket(t, len(body), now)
                rep = self._exchange(sock, t, method, msgspec.Raw(body), meanwhile)
                self._used = now
            except TimeoutError as exc:
                self._reset()
                raise Timeout(f"rpc {method} to {self.endpoint} timed out after {t}s") from exc
            except NotRpcPeer:
                self._reset()
                raise
            except (OSError, Unavailable, ProtocolError) as exc:
                self._reset()
                raise Unavailable(f"rpc {method} to {self.endpoint} failed: {exc}") from exc
            except KVPlaneError:
                self._reset()  # the handshake was refused: the server closes this connection
                raise
        if rep.code:
            raise from_code(rep.code, rep.error)
        return wire.decode(rep.body, reply_type)

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        """Close the connection (idempotent)."""
        with self._lock:
            self._reset()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
