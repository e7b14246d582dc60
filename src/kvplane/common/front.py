"""HttpFront: one thread that accepts an HTTP port and pre-authenticates every connection.

The front owns the listening socket. A single selector thread accepts, admits each connection
under :class:`~kvplane.common.guard.Admission` (unauthenticated connections capped per peer and
per port, oldest closed first), reads its first request head (at most ``MAX_HEAD`` bytes,
within the handshake timeout) and checks its token. Junk, slow, idle and unauthenticated
connections are answered and closed here, without a thread or an event-loop callback each;
accepted ones leave the front through ``handoff(sock, head)`` (to uvicorn's loop).

Imports only ``kvplane.common``.
"""

from __future__ import annotations

import errno
import functools
import heapq
import itertools
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvplane.common.auth import Authenticator
from kvplane.common.guard import REJECTED, Admission, Limits, PeerLog, Ticket
from kvplane.common.http_guard import Head, Refused, check_head, parse_head

log = logging.getLogger(__name__)
_ACCEPT_BURST = 16  # connections accepted per wake-up, so served clients are not kept waiting
# A refused request's unread body would turn close() into a reset that can reach the client
# before the answer (httpx then reports "connection reset", not the 401). So a refused
# connection is half-closed and drained for a moment; bounded in time and in count.
_LINGER_S = 0.5
_MAX_LINGER = 256
_WAKE = "wake"  # the selector key of the pair that wakes the thread to close


@dataclass(eq=False)
class _Pending:
    sock: socket.socket
    ticket: Ticket
    deadline: float
    buf: bytearray = field(default_factory=bytearray)


class HttpFront:
    """Accepts on ``host:port`` and hands pre-authenticated connections to ``handoff``.

    Args:
        host: bind address.
        port: 0 picks a free one (read ``.port``).
        limits: caps and the handshake timeout.
        authenticate: token -> principal (None: no token check).
        name: thread name and metrics label.
        handoff: takes ``(sock, head)`` of an accepted connection (non-blocking socket); runs on
            the front's thread, so it must not block.
    """

    def __init__(self, host: str, port: int, limits: Limits, authenticate: Authenticator | None,
                 name: str, handoff: Callable[[socket.socket, Head], None]) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._lsock = socket.create_server((host, port), family=family, backlog=1024)
        self._lsock.setblocking(False)
        self.host, self.port = self._lsock.getsockname()[:2]
        self.limits, self.admission = limits, Admission(limits, name)
        self._auth, self._name, self._handoff = authenticate, name, handoff
        self.peer_log = PeerLog(log)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._lsock, selectors.EVENT_READ, None)
        # An idle front sleeps until a connection, a deadline or close() (a process holds one
        # front per HTTP port, and a host may run dozens of segment processes: a poll each
        # would wake them all, every one, many times a second).
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._pending: dict[int, _Pending] = {}
        self._deadlines: list[tuple[float, int, int]] = []  # (deadline, seq, fd)
        self._seq = itertools.count()
        self._linger: dict[int, tuple[socket.socket, float]] = {}  # fd -> (sock, close at)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-front-{self.port}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._closed.is_set():
                for key, _ in self._sel.select(self._wait()):
                    if key.data is None:
                        self._accept()
                    elif key.data is _WAKE:
                        continue  # close(): the loop's test ends it
                    elif isinstance(key.data, socket.socket):
                        self._drain(key.data)
                    else:
                        self._read(key.data)
                self._expire(time.monotonic())
                self._unlinger(time.monotonic())
                time.sleep(0)  # let the event loop's thread take the GIL between bursts
        finally:
            for p in list(self._pending.values()):
                self._drop(p)
            self._unlinger(float("inf"))
            self._sel.close()

    def _wait(self) -> float | None:
        """Seconds until the next handshake deadline or lingering close (None: none due)."""
        due = [self._deadlines[0][0]] if self._deadlines else []
        if self._linger:
            due.append(min(at for _, at in self._linger.values()))
        return max(0.0, min(due) - time.monotonic()) if due else None

    def _accept(self) -> None:
        for _ in range(_ACCEPT_BURST):
            try:
                conn, addr = self._lsock.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self.peer_log.warn("*", "accept failed (%s); backing off", exc)
                    self._closed.wait(0.05)
                return
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            box: list[_Pending] = []
            ticket = self.admission.admit(str(addr[0]), functools.partial(self._drop_boxed, box))
            if ticket is None:
                conn.close()
                continue
            p = _Pending(conn, ticket, time.monotonic() + self.limits.handshake_timeout)
            box.append(p)
            fd = conn.fileno()
            self._pending[fd] = p
            self._sel.register(conn, selectors.EVENT_READ, p)
            heapq.heappush(self._deadlines, (p.deadline, next(self._seq), fd))

    def _read(self, p: _Pending) -> None:
        try:
            chunk = p.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._refuse(p, Refused("closed", "closed before a complete request head"))
            return
        p.buf += chunk
        try:
            if not check_head(p.buf):
                return
            head = parse_head(bytes(p.buf), self._auth)
        except Refused as exc:
            self._refuse(p, exc)
            return
        self._forget(p)
        self.admission.release(p.ticket)
        self._handoff(p.sock, head)

    def _expire(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, fd = heapq.heappop(self._deadlines)
            p = self._pending.get(fd)
            if p is not None and p.deadline <= now:
                self._refuse(p, Refused("handshake_timeout", "no complete request head within "
                                        f"{self.limits.handshake_timeout}s"))

    def _refuse(self, p: _Pending, exc: Refused) -> None:
        REJECTED.labels(self._name, exc.reason).inc()
        if exc.reason != "closed":
            self.peer_log.warn(p.ticket.peer, "closing HTTP connection (%s): %s", exc.reason, exc)
        if exc.reply:
            try:
                p.sock.send(exc.reply)
            except OSError:
                pass
            else:
                if len(self._linger) < _MAX_LINGER:
                    self._forget(p)
                    self.admission.release(p.ticket)
                    self._start_linger(p.sock)
                    return
        self._drop(p)

    def _start_linger(self, sock: socket.socket) -> None:
        try:
            sock.shutdown(socket.SHUT_WR)  # the answer is sent; the peer sees its end
        except OSError:
            sock.close()
            return
        self._linger[sock.fileno()] = (sock, time.monotonic() + _LINGER_S)
        self._sel.register(sock, selectors.EVENT_READ, sock)

    def _drain(self, sock: socket.socket) -> None:
        """Discard what a refused peer still sends; close at its end of stream."""
        try:
            if sock.recv(65536):
                return
        except BlockingIOError:
            return
        except OSError:
            pass
        self._close_linger(sock.fileno())

    def _unlinger(self, now: float) -> None:
        for fd in [fd for fd, (_, at) in self._linger.items() if at <= now]:
            self._close_linger(fd)

    def _close_linger(self, fd: int) -> None:
        sock, _ = self._linger.pop(fd)
        self._sel.unregister(sock)
        sock.close()

    def _forget(self, p: _Pending) -> None:
        fd = p.sock.fileno()
        if self._pending.pop(fd, None) is not None:
            self._sel.unregister(p.sock)

    def _drop_boxed(self, box: list[_Pending]) -> None:
        """Drop the connection in ``box`` if it got that far (the admission may evict it before
        it is registered: the box is filled after ``admit``)."""
        if box:
            self._drop(box[0])

    def _drop(self, p: _Pending) -> None:
        self._forget(p)
        self.admission.release(p.ticket)
        p.sock.close()

    def close(self) -> None:
        """Stop accepting; drop connections not yet handed off (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(2)
        self._lsock.close()
        if not self._thread.is_alive():
            self._wake_r.close()
            self._wake_w.close()
