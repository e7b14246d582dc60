"""The pre-authentication guard of every kvplane HTTP server, and its per-request token gate.

An HTTP server's port belongs to :class:`~kvplane.common.front.HttpFront`, not to uvicorn: it
admits each connection, reads the first request's head within the handshake timeout (at most
``MAX_HEAD`` bytes, :func:`check_head`) and checks its token (:func:`parse_head`) before the
event loop ever sees the connection. Junk, idle and slow connections, and requests without a
valid token, are answered and closed there, so a flood of them costs the event loop nothing.
Accepted connections are handed, with the bytes already read, to uvicorn's loop.

* :class:`GuardedH11` is uvicorn's h11 protocol for those connections: it replays the head,
  gives every later request ``handshake_timeout`` for its headers and ``request_timeout`` for its
  body (slowloris), closes a connection that never authenticated (an open ``/health`` probe)
  after its response, and logs bad requests once per peer.
* :class:`TokenGate` is ASGI middleware checking the token of every request (keep-alive
  requests after the first too) on every path except ``/health``, before the app reads a byte.
  The caller's :class:`~kvplane.common.auth.Principal` goes in ``scope["state"]["principal"]``.
* :class:`QuietDisconnect` turns a client that went away mid-request into one rate-limited line
  instead of a traceback.

Imports only ``kvplane.common``; binds nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvplane.common.auth import ADMIN, Authenticator, Principal
from kvplane.common.errors import Unauthorized
from kvplane.common.guard import REJECTED, Limits, PeerLog

log = logging.getLogger(__name__)
PRINCIPAL_KEY = "principal"
OPEN_PATHS = frozenset({"/health"})
# pages a browser opens by URL: they may carry the token as ``?token=`` (a browser cannot set a
# header on a typed-in URL); every other path takes it from a header only
QUERY_TOKEN_PATHS = frozenset({"/dashboard"})
MAX_HEAD = 16 << 10
_METHODS = (b"GET ", b"PUT ", b"POST ", b"DELETE ", b"HEAD ", b"OPTIONS", b"PATCH ")


@dataclass
class Head:
    """The first request of a connection, as :func:`parse_head` read and authenticated it."""

    raw: bytes
    path: str
    principal: Principal | None


class Refused(Exception):
    """Close the connection: ``reason`` is a metrics label, ``reply`` what to send first."""

    def __init__(self, reason: str, detail: str, reply: bytes = b"") -> None:
        super().__init__(detail)
        self.reason, self.reply = reason, reply


def _reply(status: str, detail: str, code: int = 0) -> bytes:
    body = json.dumps({"detail": detail, **({"code": code} if code else {})}).encode()
    extra = "WWW-Authenticate: Bearer\r\n" if status.startswith("401") else ""
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
            f"\r\n{extra}Connection: close\r\n\r\n").encode() + body


UNAUTHORIZED = _reply("401 Unauthorized", "missing or wrong token (X-KVPlane-Token or "
                      "Authorization: Bearer)", Unauthorized.code)


def check_head(buf: bytes | bytearray) -> bool:
    """True once ``buf`` holds a whole request head.

    Raises:
        Refused: not HTTP, or a head larger than ``MAX_HEAD``.
    """
    if len(buf) >= 8 and not bytes(buf[:8]).startswith(_METHODS):
        raise Refused("garbage", "not an HTTP request", _reply("400 Bad Request", "bad request"))
    if b"\r\n\r\n" in buf:
        return True
    if len(buf) > MAX_HEAD:
        raise Refused("oversized_head", f"request head over {MAX_HEAD} bytes",
                      _reply("431 Request Header Fields Too Large", "request head too large"))
    return False


def parse_head(raw: bytes, authenticate: Authenticator | None) -> Head:
    """Parse a whole first request head and check its token.

    Raises:
        Refused: a bad request line, or a missing/wrong token off the open paths.
    """
    head, _, _ = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        raise Refused("garbage", "bad request line", _reply("400 Bad Request", "bad request"))
    path, _, query = parts[1].decode("latin-1").partition("?")
    headers = []
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers.append((name.strip().lower(), value.strip()))
    principal = ADMIN if authenticate is None else authenticate(
        presented_token(headers) or query_token(path, query))
    if principal is None and path not in OPEN_PATHS:
        raise Refused("bad_token", f"{parts[0].decode('latin-1')} {path} without a valid token",
                      UNAUTHORIZED)
    return Head(raw, path, principal)


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol for a connection whose head :func:`parse_head` accepted (see the
    module docstring)."""

    limits: Limits = Limits()
    peer_log: PeerLog = PeerLog(log)
    server_name = "http"

    def __init__(self, *args: Any, head: Head | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._head = head
        self._timer: asyncio.TimerHandle | None = None
        self._phase = ""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # asyncio.BaseTransport in the base, a socket one here
        super().connection_made(transport)
        self.logger = _QuietLogger(self.logger, self.peer_log, self.client)  # type: ignore[assignment]  # uvicorn types its logger as logging.Logger
        if self._head is not None:
            self.data_received(self._head.raw)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.IDLE and self.conn.trailing_data[0]:
            self._arm("headers")
        elif state is h11.SEND_BODY:
            self._arm("body")
        else:
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._head is not None and self._head.principal is None:
            self.transport.close()  # an open-path probe without a token gets one answer

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, phase: str) -> None:
        if self._phase == phase and self._timer is not None:
            return
        self._disarm()
        seconds = self.limits.handshake_timeout if phase == "headers" else self.limits.request_timeout
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
        REJECTED.labels(self.server_name, f"{phase}_timeout").inc()
        self.peer_log.warn(self.client[0] if self.client else "?",
                           "closing HTTP connection: request %s not received in time", phase)
        self.transport.abort()


class _QuietLogger:
    """uvicorn's per-connection logger with warnings (bad requests) rate-limited per peer."""

    def __init__(self, inner: logging.Logger, peer_log: PeerLog, client: Any) -> None:
        self._inner, self._peer_log = inner, peer_log
        self._peer = str(client[0]) if client else "?"

    def warning(self, msg: str, *args: object) -> None:
        self._peer_log.warn(self._peer, "HTTP: " + msg, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def guarded_protocol(limits: Limits, name: str) -> type[GuardedH11]:
    """A :class:`GuardedH11` subclass carrying ``limits`` and its own quiet log."""
    attrs = {"limits": limits, "peer_log": PeerLog(log), "server_name": name}
    return type(f"GuardedH11_{name}", (GuardedH11,), attrs)


def presented_token(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The token a request carries: ``X-KVPlane-Token``, else ``Authorization: Bearer``."""
    bearer = ""
    for k, v in headers:
        if k == b"x-kvplane-token":
            return v.decode("latin-1")
        if k == b"authorization" and v[:7].lower() == b"bearer ":
            bearer = v[7:].decode("latin-1").strip()
    return bearer


def query_token(path: str, query: str) -> str:
    """The ``token`` query parameter, on the paths of ``QUERY_TOKEN_PATHS`` only ("" elsewhere)."""
    if path not in QUERY_TOKEN_PATHS or not query:
        return ""
    from urllib.parse import parse_qs

    try:
        return parse_qs(query, max_num_fields=16).get("token", [""])[0]
    except ValueError:  # too many fields
        return ""


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
        query = bytes(scope.get("query_string", b"")).decode("latin-1")
        principal = self.authenticate(presented_token(scope.get("headers", ()))
                                      or query_token(str(scope.get("path", "")), query))
        if principal is None and scope.get("path") not in self.open_paths:
            client = scope.get("client") or ("?",)
            self.peer_log.warn(str(client[0]), "HTTP %s %s without a valid token",
                               scope.get("method"), scope.get("path"))
            await _discard_body(receive)
            await _send_raw(send, 401, UNAUTHORIZED)
            return
        scope.setdefault("state", {})[PRINCIPAL_KEY] = principal
        if principal is None:  # a tokenless probe of an open path gets one answer: say so
            await self.app(scope, receive, _closing(send))
            return
        await self.app(scope, receive, send)


def _closing(send: Any) -> Any:
    """``send`` with ``Connection: close`` on the response, so the client does not reuse a
    connection the server closes after this answer (GuardedH11.on_response_complete)."""
    async def wrapped(message: Any) -> None:
        if message.get("type") == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()),
                                              (b"connection", b"close")]}
        await send(message)
    return wrapped


async def _discard_body(receive: Any, cap: int = 65536) -> None:
    """Read (and drop) up to ``cap`` bytes of a refused request's body: a connection closed
    with its body unread is reset, and the reset can reach the client before the 401."""
    seen = 0
    while seen <= cap:
        message = await receive()
        if message.get("type") != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body"):
            return


async def _send_raw(send: Any, status: int, raw: bytes) -> None:
    body = raw.partition(b"\r\n\r\n")[2]
    await send({"type": "http.response.start", "status": status,
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
    return request.scope.get("state", {}).get(PRINCIPAL_KEY)  # type: ignore[no-any-return]  # ASGI scope state is untyped
