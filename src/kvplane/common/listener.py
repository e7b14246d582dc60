"""Listener: a TCP accept loop that serves each connection on its own named daemon thread.

Shared by the transfer engine's data server and the control RPC server. Blocking per-connection
threads are the fastest request/response path in CPython (no event-loop hop). Connections past
``max_connections`` are refused; ``close`` stops accepting and shuts every connection down.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable


class Listener:
    """Accepts on ``host:port`` and runs ``serve(conn)`` per connection; closes ``conn`` after.

    Args:
        serve: handles one connection until it ends; must not close it.
        host: bind address.
        port: 0 picks a free port (read ``.port``).
        name: thread-name prefix.
        max_connections: further connections are closed at once (``on_refuse`` is called).
        on_refuse: called for each refused connection (metrics).
    """

    def __init__(self, serve: Callable[[socket.socket], None], host: str = "127.0.0.1",
                 port: int = 0, name: str = "listener", max_connections: int = 512,
                 on_refuse: Callable[[], None] = lambda: None) -> None:
        self._serve = serve
        self._name = name
        self._max = max_connections
        self._on_refuse = on_refuse
        self._lsock = socket.create_server((host, port), backlog=256)
        self.host, self.port = self._lsock.getsockname()[:2]
        self.conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name=f"{name}-accept-{self.port}",
                                        daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, addr = self._lsock.accept()
            except OSError:
                return
            with self._lock:
                if len(self.conns) >= self._max:
                    conn.close()
                    self._on_refuse()
                    continue
                self.conns.add(conn)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._run, args=(conn,), daemon=True,
                             name=f"{self._name}-conn-{addr[1]}").start()

    def _run(self, conn: socket.socket) -> None:
        try:
            self._serve(conn)
        finally:
            with self._lock:
                self.conns.discard(conn)
            conn.close()

    def close(self) -> None:
        """Stop accepting and shut every connection down (idempotent)."""
        if self.closed.is_set():
            return
        self.closed.set()
        try:
            self._lsock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._lsock.close()
        with self._lock:
            conns = list(self.conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(2)
