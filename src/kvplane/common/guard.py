"""Pre-authentication guard of every listener: connection admission, limits, quiet logging.

A connection is *unauthenticated* from accept until it proves the token (its first RPC frame,
its data HELLO, or an HTTP request that passes the token gate). Unauthenticated connections
are cheap to hold and capped: at most ``max_preauth`` per listener and ``max_preauth_per_peer``
per peer address. A new connection past a cap closes the *oldest* unauthenticated one (of that
peer, or of the peer holding the most), so a flood of idle or junk sockets cannot lock anyone
out: a real client's connection authenticates within a round trip. Authenticated connections
count against ``max_connections``; when it is reached and nothing unauthenticated is left to
close, the new connection is refused. Until authenticated a peer may send at most
``preauth_frame`` bytes in one frame and has ``handshake_timeout`` seconds to do it.

:class:`PeerLog` logs one line per bad peer at a time: the first rejection of a peer is logged,
further ones within ``window`` seconds are counted and reported with the next line.

Imports only ``kvplane.common``; binds nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from kvplane.common import envs, metrics
from kvplane.common.errors import InvalidArgument

REJECTED = metrics.Counter("kvplane_listener_rejected_total",
                           "Connections closed before or instead of serving them",
                           ["listener", "reason"])


@dataclass(frozen=True)
class Limits:
    """Connection limits of one listener (defaults from the KVPLANE_* table).

    Attributes:
        max_connections: connections held at once (authenticated or not).
        max_preauth: unauthenticated connections held at once; past it the oldest is closed.
        max_preauth_per_peer: unauthenticated connections of one peer address.
        handshake_timeout: seconds a new connection has to authenticate.
        idle_timeout: seconds an authenticated connection may stay idle (0 = forever, else >= 2).
        preauth_frame: largest frame read from an unauthenticated peer, bytes.
        request_timeout: seconds an HTTP client has to send a request body once headers arrived.
    """

    max_connections: int = 1024
    max_preauth: int = 64
    max_preauth_per_peer: int = 16
    handshake_timeout: float = 5.0
    idle_timeout: float = 300.0
    preauth_frame: int = 64 << 10
    request_timeout: float = 30.0

    def __post_init__(self) -> None:
        if min(self.max_connections, self.max_preauth, self.max_preauth_per_peer) < 1:
            raise InvalidArgument("connection limits must be >= 1")
        if self.handshake_timeout <= 0 or self.request_timeout <= 0:
            raise InvalidArgument("handshake and request timeouts must be > 0")
        if self.idle_timeout != 0 and self.idle_timeout < 2:
            # clients check a pooled connection for a server-side close after 1 s idle
            raise InvalidArgument("idle_timeout must be 0 (never) or >= 2 seconds")
        if self.preauth_frame < 1024:
            raise InvalidArgument("preauth_frame must be >= 1 KiB")

    @classmethod
    def from_env(cls, **overrides: Any) -> Limits:
        """Defaults, then the KVPLANE_* environment, then explicit ``overrides`` (which win)."""
        base = cls(max_preauth=envs.get("KVPLANE_MAX_PREAUTH"),
                   max_preauth_per_peer=envs.get("KVPLANE_MAX_PREAUTH_PER_PEER"),
                   handshake_timeout=envs.get("KVPLANE_HANDSHAKE_TIMEOUT"),
                   idle_timeout=envs.get("KVPLANE_IDLE_TIMEOUT"),
                   preauth_frame=envs.get("KVPLANE_PREAUTH_FRAME"),
                   request_timeout=envs.get("KVPLANE_HTTP_REQUEST_TIMEOUT"))
        return replace(base, **{k: v for k, v in overrides.items() if v is not None})


@dataclass(eq=False)
class Ticket:
    """One admitted connection. ``close`` wakes whatever serves it (shutdown, abort)."""

    peer: str
    close: Callable[[], None]
    authed: bool = False
    gone: bool = False
    since: float = field(default_factory=time.monotonic)


class Admission:
    """Admits connections under :class:`Limits` (see the module docstring). Thread-safe.

    Args:
        limits: the caps.
        name: listener name (metrics label).
    """

    def __init__(self, limits: Limits, name: str) -> None:
        self.limits = limits
        self.name = name
        self._lock = threading.Lock()
        self._pre: dict[str, OrderedDict[int, Ticket]] = {}
        self._npre = 0
        self._nauth = 0

    def admit(self, peer: str, close: Callable[[], None]) -> Ticket | None:
        """Admit a new connection from ``peer``; None means refuse it (close it at once).

        May close older unauthenticated connections (their ``close`` is called, outside the lock).
        """
        lim = self.limits
        victims: list[Ticket] = []
        with self._lock:
            own = self._pre.get(peer)
            if own is not None and len(own) >= lim.max_preauth_per_peer:
                victims.append(self._drop_oldest(peer))
            if self._npre >= lim.max_preauth:
                victims.append(self._drop_oldest(self._busiest()))
            if self._npre + self._nauth >= lim.max_connections:
                if not self._npre:
                    refuse = True
                else:
                    victims.append(self._drop_oldest(self._busiest()))
                    refuse = False
            else:
                refuse = False
            ticket = None
            if not refuse:
                ticket = Ticket(peer, close)
                self._pre.setdefault(peer, OrderedDict())[id(ticket)] = ticket
                self._npre += 1
        for v in victims:
            REJECTED.labels(self.name, "evicted_unauthenticated").inc()
            v.close()
        if refuse:
            REJECTED.labels(self.name, "full").inc()
        return ticket

    def authenticate(self, ticket: Ticket) -> None:
        """Move ``ticket`` to the authenticated pool (idempotent; no-op once released)."""
        with self._lock:
            if ticket.authed or ticket.gone:
                return
            self._unlink(ticket)
            ticket.authed = True
            self._nauth += 1

    def release(self, ticket: Ticket) -> None:
        """The connection ended (idempotent)."""
        with self._lock:
            if ticket.gone:
                return
            if ticket.authed:
                self._nauth -= 1
            else:
                self._unlink(ticket)
            ticket.gone = True

    def counts(self) -> tuple[int, int]:
        """(unauthenticated, authenticated) connections held now."""
        with self._lock:
            return self._npre, self._nauth

    # under the lock ---------------------------------------------------------------------------
    def _unlink(self, ticket: Ticket) -> None:
        own = self._pre.get(ticket.peer)
        if own is not None and own.pop(id(ticket), None) is not None:
            self._npre -= 1
            if not own:
                del self._pre[ticket.peer]

    def _busiest(self) -> str:
        return max(self._pre, key=lambda p: len(self._pre[p]))

    def _drop_oldest(self, peer: str) -> Ticket:
        own = self._pre[peer]
        _, ticket = own.popitem(last=False)
        self._npre -= 1
        if not own:
            del self._pre[peer]
        ticket.gone = True
        return ticket


class PeerLog:
    """Rate-limited warnings about bad peers: one line per peer per ``window`` seconds.

    Args:
        logger: where lines go.
        window: seconds after a logged line during which the same peer is only counted.
        max_peers: peers remembered (oldest forgotten first).
        clock: monotonic clock (tests inject one).
    """

    def __init__(self, logger: logging.Logger, window: float = 60.0, max_peers: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._window = window
        self._max = max_peers
        self._clock = clock
        self._lock = threading.Lock()
        self._peers: OrderedDict[str, list[float]] = OrderedDict()  # peer -> [logged_at, quiet]
        self.lines = 0
        self.suppressed = 0

    def warn(self, peer: str, msg: str, *args: object) -> bool:
        """Log ``msg % args`` about ``peer`` unless it was logged within the window.

        Returns True when a line was written.
        """
        now = self._clock()
        with self._lock:
            entry = self._peers.get(peer)
            if entry is not None and now - entry[0] < self._window:
                entry[1] += 1
                self.suppressed += 1
                return False
            quiet = int(entry[1]) if entry is not None else 0
            self._peers[peer] = [now, 0]
            self._peers.move_to_end(peer)
            while len(self._peers) > self._max:
                self._peers.popitem(last=False)
            self.lines += 1
        suffix = f" ({quiet} more from this peer since the last report)" if quiet else ""
        self._log.warning("peer %s: " + msg + "%s", peer, *args, suffix)
        return True
