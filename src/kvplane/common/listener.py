"""Listener: a TCP accept loop that serves each connection on its own named daemon thread.

A thread whose connection ended waits a while (``KEEP_FOR``, at most ``KEEP_IDLE`` of them per
listener) for the next accepted connection, so a new connection usually does not pay a thread
start: on this project's 2-core VM a fresh connection's first answer took 170-240 µs where the
next one on it took 41 µs, most of the difference the start of its thread.

With ``local=True`` it also accepts on an abstract Unix socket (``local_name``) that same-host
clients move to after connecting over TCP (:mod:`kvplane.common.local`); those connections go
through the same admission, handshake and limits, as peer ``local``.

Shared by the transfer engine's data server and the control RPC server. Blocking per-connection
threads are the fastest request/response path in CPython (no event-loop hop). Every connection
goes through :class:`~kvplane.common.guard.Admission`: it starts unauthenticated (capped per peer
and per listener, oldest closed first) until the server calls :meth:`Listener.authenticated`;
past ``max_connections`` new connections are refused. ``close`` stops accepting and shuts every
connection down.
"""

from __future__ import annotations

import collections
import errno
import functools
import logging
import socket
import threading
import time
from collections.abc import Callable

from kvplane.common import local as local_sockets
from kvplane.common.guard import REJECTED, Admission, Limits, PeerLog, Ticket

log = logging.getLogger(__name__)
_TRANSIENT = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED,
              errno.EPERM, errno.EPROTO}
KEEP_IDLE = 8  # threads of a listener kept waiting for its next connection
KEEP_FOR = 30.0  # seconds such a thread waits before it ends


def _shutdown(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class Listener:
    """Accepts on ``host:port`` and runs ``serve(conn)`` per connection; closes ``conn`` after.

    Args:
        serve: handles one connection until it ends; must not close it.
        host: bind address.
        port: 0 picks a free port (read ``.port``).
        name: thread-name prefix (and metrics label).
        max_connections: further connections are closed at once (``on_refuse`` is called).
        on_refuse: called for each refused connection (metrics).
        limits: pre-authentication limits (default: ``Limits.from_env``); ``max_connections``
            overrides its field of the same name.
        listen: accept from construction on (default). False: the port is bound (and ``.port``
            known) but not listening, so a connect is refused, until :meth:`start`: a server
            opens its port only once it can serve (clients retry refused connects).
        local: also accept on a fresh abstract Unix socket (``local_name``; "" when
            ``KVPLANE_LOCAL_SOCKETS=0`` or none could be bound).
    """

    def __init__(self, serve: Callable[[socket.socket], None], host: str = "127.0.0.1",
                 port: int = 0, name: str = "listener", max_connections: int = 512,
                 on_refuse: Callable[[], object] = lambda: None, limits: Limits | None = None,
                 listen: bool = True, local: bool = False) -> None:
        self._serve = serve
        self._name = name
        self._on_refuse = on_refuse
        self.limits = Limits.from_env(max_connections=max_connections) if limits is None else limits
        self.admission = Admission(self.limits, name)
        self._peer_log = PeerLog(log)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._lsock = socket.socket(family, socket.SOCK_STREAM)
        try:  # socket.create_server's bind, with the listen() left to start()
            self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._lsock.bind((host, port))
        except OSError:
            self._lsock.close()
            raise
        self.host, self.port = self._lsock.getsockname()[:2]
        bound = local_sockets.bind() if local else None
        self._usock: socket.socket | None = bound[0] if bound is not None else None
        self.local_name = bound[1] if bound is not None else ""
        self.conns: set[socket.socket] = set()
        self._tickets: dict[socket.socket, Ticket] = {}
        self._lock = threading.Lock()
        self.closed = threading.Event()
        self._kept = threading.Condition(threading.Lock())  # idle threads wait here
        self._handed: collections.deque[tuple[socket.socket, str]] = collections.deque()
        self._waiting: set[threading.Thread] = set()
        self._thread = threading.Thread(target=self._accept, args=(self._lsock,),
                                        name=f"{name}-accept-{self.port}", daemon=True)
        self._uthread = threading.Thread(target=self._accept, args=(self._usock,),
                                         name=f"{name}-accept-local-{self.port}", daemon=True)
        if listen:
            self.start()

    def start(self) -> None:
        """Listen and accept (idempotent; a no-op once closed)."""
        with self._lock:
            if self._thread.ident is not None or self.closed.is_set():
                return
            self._lsock.listen(256)
            self._thread.start()
            if self._usock is not None:
                self._usock.listen(256)
                self._uthread.start()

    def _accept(self, lsock: socket.socket) -> None:
        unix = lsock.family == socket.AF_UNIX
        while not self.closed.is_set():
            try:
                conn, addr = lsock.accept()
            except OSError as exc:
                if self.closed.is_set() or exc.errno not in _TRANSIENT:
                    return
                # out of file descriptors or memory: back off instead of dying (or spinning)
                REJECTED.labels(self._name, "accept_" + errno.errorcode.get(exc.errno or 0, "?")).inc()
                self._peer_log.warn("*", "accept failed (%s); retrying", exc)
                self.closed.wait(0.05)
                continue
            peer, tag = ("local", "local") if unix else (str(addr[0]), addr[1])
            ticket = self.admission.admit(peer, functools.partial(_shutdown, conn))
            if ticket is None:
                conn.close()
                self._on_refuse()
                continue
            with self._lock:
                self.conns.add(conn)
                self._tickets[conn] = ticket
            if not unix:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not self._hand_over(conn, tag):
                threading.Thread(target=self._work, args=(conn,), daemon=True,
                                 name=f"{self._name}-conn-{tag}").start()

    def _hand_over(self, conn: socket.socket, tag: object) -> bool:
        """Give ``conn`` (from peer ``tag``) to a kept idle thread; False when none is free."""
        with self._kept:
            if len(self._waiting) <= len(self._handed):
                return False
            self._handed.append((conn, f"{self._name}-conn-{tag}"))
            self._kept.notify()
            return True

    def _work(self, conn: socket.socket | None) -> None:
        """Serve ``conn``, then the connections handed over while this thread is kept."""
        while conn is not None:
            self._run(conn)
            conn = self._next()

    def _next(self) -> socket.socket | None:
        """The next handed-over connection, or None when this thread should end (enough are
        kept already, the listener closed, or none came within ``KEEP_FOR``)."""
        me = threading.current_thread()
        with self._kept:
            if len(self._waiting) >= KEEP_IDLE:
                return None
            self._waiting.add(me)
            try:
                end = time.monotonic() + KEEP_FOR
                while not self._handed:  # (one handed over is served even after a close)
                    left = end - time.monotonic()
                    if left <= 0 or self.closed.is_set():
                        return None
                    self._kept.wait(left)
                conn, me.name = self._handed.popleft()
                return conn
            finally:
                self._waiting.discard(me)

    def authenticated(self, conn: socket.socket) -> None:
        """``conn`` proved the token: it no longer counts (or can be closed) as unauthenticated."""
        ticket = self._tickets.get(conn)
        if ticket is not None:
            self.admission.authenticate(ticket)

    def peer(self, conn: socket.socket) -> str:
        """The peer address ``conn`` was accepted from."""
        ticket = self._tickets.get(conn)
        return ticket.peer if ticket is not None else "?"

    def _run(self, conn: socket.socket) -> None:
        try:
            self._serve(conn)
        finally:
            with self._lock:
                self.conns.discard(conn)
                ticket = self._tickets.pop(conn, None)
            if ticket is not None:
                self.admission.release(ticket)
            conn.close()

    def close(self) -> None:
        """Stop accepting and shut every connection down (idempotent)."""
        if self.closed.is_set():
            return
        self.closed.set()
        for ls in (self._lsock, self._usock):
            if ls is not None:
                _shutdown(ls)
                ls.close()
        with self._lock:
            conns = list(self.conns)
        for c in conns:
            _shutdown(c)
        for t in (self._thread, self._uthread):
            if t.ident is not None:
                t.join(2)
        with self._kept:
            self._kept.notify_all()  # kept idle threads end
            kept = list(self._waiting)
        for t in kept:
            t.join(2)
