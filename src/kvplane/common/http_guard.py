"""The pre-authentication guard of every kvplane HTTP server (uvicorn, h11), and its token gate.

* :func:`guarded_protocol` builds uvicorn's HTTP protocol class with
  :class:`~kvplane.common.guard.Admission` in front: unauthenticated connections are capped per
  peer and per server (oldest closed first), a request's headers must arrive within the
  handshake timeout and its body within the request timeout, so partial requests (slowloris)
  cannot hold the server. uvicorn's own ``limit_concurrency`` (which answers 503 to everyone)
  is not used.
* :class:`TokenGate` is ASGI middleware that checks the token (``X-KVPlane-Token`` or
  ``Authorization: Bearer``) before the app reads anything, on every path except the open ones
  (``/health``). It puts the caller's :class:`~kvplane.common.auth.Principal` in
  ``scope["state"]["principal"]`` and marks the connection authenticated.
* :class:`QuietDisconnect` turns a client that went away mid-request into one rate-limited log
  line instead of a traceback.

Imports only ``kvplane.common``; binds nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvplane.common.auth import Authenticator, Principal
from kvplane.common.errors import Unauthorized
from kvplane.common.guard import REJECTED, Admission, Limits, PeerLog

log = logging.getLogger(__name__)
CONN_KEY = "kvplane_connection"
PRINCIPAL_KEY = "principal"
OPEN_PATHS = ("/health",)


class _GuardedH11(H11Protocol):
    """uvicorn's h11 protocol behind an Admission; see the module docstring."""

    admission: Admission
    peer_log: PeerLog
    server_name: str

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._timer: asyncio.TimerHandle | None = None
        self._phase = ""
        peer = self.client[0] if self.client else "?"
        self._ticket = self.admission.admit(peer, self._evict)
        if self._ticket is None:
            transport.abort()
            return
        self.app_state = {**self.app_state, CONN_KEY: self}
        self._arm("headers")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.IDLE:
            self._arm("headers")
        elif state is h11.SEND_BODY:
            self._arm("body")
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if getattr(self, "_ticket", None) is not None:
            self.admission.release(self._ticket)
        super().connection_lost(exc)

    def authenticated(self) -> None:
        """The token gate accepted a request on this connection."""
        if self._ticket is not None:
            self.admission.authenticate(self._ticket)

    def _arm(self, phase: str) -> None:
        if self._phase == phase and self._timer is not None:
            return
        self._disarm()
        lim = self.admission.limits
        seconds = lim.handshake_timeout if phase == "headers" else lim.request_timeout
        self._phase = phase
        self._timer = self.loop.call_later(seconds, self._expire, phase)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._phase = None, ""

    def _expire(self, phase: str) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if phase == "headers" and self.cycle is not None and self.conn.their_state is h11.IDLE \
                and not self._partial():
            self.transport.close()  # idle keep-alive: uvicorn's own timer normally gets here first
            return
        REJECTED.labels(self.server_name, f"{phase}_timeout").inc()
        self.peer_log.warn(self.client[0] if self.client else "?",
                           "closing HTTP connection: request %s not received in time", phase)
        self.transport.abort()

    def _partial(self) -> bool:
        """Bytes of a next request are buffered (its headers are incomplete)."""
        return bool(self.conn.trailing_data[0])

    def _evict(self) -> None:
        if not self.transport.is_closing():
            self.transport.abort()


def guarded_protocol(limits: Limits, name: str) -> type[asyncio.Protocol]:
    """A uvicorn ``http=`` protocol class with its own Admission under ``limits``."""
    attrs = {"admission": Admission(limits, name), "peer_log": PeerLog(log), "server_name": name}
    return type(f"GuardedH11_{name}", (_GuardedH11,), attrs)


def presented_token(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The token a request carries: ``X-KVPlane-Token``, else ``Authorization: Bearer``."""
    bearer = ""
    for k, v in headers:
        if k == b"x-kvplane-token":
            return v.decode("latin-1")
        if k == b"authorization" and v[:7].lower() == b"bearer ":
            bearer = v[7:].decode("latin-1").strip()
    return bearer


class TokenGate:
    """ASGI middleware: every path but ``open_paths`` needs a token ``authenticate`` accepts.

    Args:
        app: the ASGI app.
        authenticate: token -> principal (None: 401).
        open_paths: exact paths served without a token (``/health``).
    """

    def __init__(self, app: Any, authenticate: Authenticator,
                 open_paths: Iterable[str] = OPEN_PATHS) -> None:
        self.app = app
        self.authenticate = authenticate
        self.open_paths = frozenset(open_paths)
        self.peer_log = PeerLog(log)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        principal: Principal | None = self.authenticate(presented_token(scope.get("headers", ())))
        state = scope.setdefault("state", {})
        if principal is None:
            if scope.get("path") not in self.open_paths:
                await self._refuse(scope, send)
                return
        else:
            conn = state.get(CONN_KEY)
            if conn is not None:
                conn.authenticated()
        state[PRINCIPAL_KEY] = principal
        await self.app(scope, receive, send)

    async def _refuse(self, scope: Any, send: Any) -> None:
        client = scope.get("client") or ("?",)
        self.peer_log.warn(str(client[0]), "HTTP %s %s without a valid token", scope.get("method"),
                           scope.get("path"))
        body = json.dumps({"detail": "missing or wrong token (X-KVPlane-Token or "
                                     "Authorization: Bearer)", "code": Unauthorized.code}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


class QuietDisconnect:
    """ASGI middleware: a client that disconnects mid-request costs one rate-limited line."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.peer_log = PeerLog(log)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        from starlette.requests import ClientDisconnect

        try:
            await self.app(scope, receive, send)
        except (ClientDisconnect, ConnectionError) as exc:
            client = scope.get("client") or ("?",)
            REJECTED.labels("http", "client_disconnect").inc()
            self.peer_log.warn(str(client[0]), "client went away mid-request %s %s (%s)",
                               scope.get("method"), scope.get("path"), type(exc).__name__)


def principal_of(request: Any) -> Principal | None:
    """The principal the token gate put on a Starlette/FastAPI request (None: open path)."""
    return request.scope.get("state", {}).get(PRINCIPAL_KEY)  # type: ignore[no-any-return]
