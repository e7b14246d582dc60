"""Control-plane RPC on pyzmq (ROUTER server, one DEALER per client) with msgspec bodies.

Every call carries a request id, a timeout and the shared token. Errors travel as numeric codes
(``kvplane.common.errors``) and are raised again on the client. Bulk bytes never go through RPC.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
import zmq

from kvplane.common import wire
from kvplane.common.errors import (
    InvalidArgument,
    KVPlaneError,
    ProtocolError,
    Timeout,
    Unauthorized,
    Unavailable,
    from_code,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
Handler = Callable[[Any], Any]


class RpcServer:
    """Serves registered methods on a ROUTER socket from one named daemon thread.

    Args:
        host: bind address (127.0.0.1 unless told otherwise).
        port: TCP port, 0 picks a free one (read it back from ``.port``).
        token: shared token; empty disables the check.
        max_message: largest request accepted, in bytes.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str = "",
                 max_message: int = wire.MAX_CONTROL_FRAME) -> None:
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.host = host
        self._token = token
        self._handlers: dict[str, tuple[Handler, type[Any]]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.malformed = 0

    def add(self, method: str, handler: Handler, request_type: type[Any]) -> None:
        """Register ``handler(request) -> reply`` for ``method``."""
        self._handlers[method] = (handler, request_type)

    def start(self) -> "RpcServer":
        """Start the serving thread."""
        self._thread = threading.Thread(target=self._serve, name=f"rpc-{self.port}", daemon=True)
        self._thread.start()
        return self

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            parts = self._sock.recv_multipart(copy=True)
            if len(parts) != 2:
                self.malformed += 1
                continue
            ident, data = parts
            reply = self._dispatch(data)
            if reply is not None:
                self._sock.send_multipart([ident, wire.encode(reply)])
        self._sock.close(0)

    def _dispatch(self, data: bytes) -> wire.Reply | None:
        try:
            env = msgspec.msgpack.decode(data, type=wire.Envelope)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.malformed += 1
            return None
        try:
            if env.v != wire.WIRE_VERSION:
                raise ProtocolError(f"wire version {env.v} not supported")
            if self._token and not hmac.compare_digest(env.token, self._token):
                raise Unauthorized("bad or missing token")
            entry = self._handlers.get(env.method)
            if entry is None:
                raise InvalidArgument(f"unknown method {env.method!r}")
            handler, rtype = entry
            req = wire.decode(env.body, rtype)
            body = wire.encode(handler(req))
            return wire.Reply(env.id, 0, "", msgspec.Raw(body))
        except KVPlaneError as exc:
            return wire.Reply(env.id, exc.code, str(exc), msgspec.Raw(wire.encode(None)))
        except Exception as exc:  # a handler bug must not kill the server
            log.exception("rpc handler %s failed", env.method)
            return wire.Reply(env.id, KVPlaneError.code, f"internal error: {exc}",
                              msgspec.Raw(wire.encode(None)))

    def close(self) -> None:
        """Stop serving (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
            self._thread = None

    def __enter__(self) -> "RpcServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class RpcClient:
    """A DEALER client. Thread-safe (calls are serialised); each call has a timeout.

    A call that times out drops its socket so a late reply cannot be matched to a later call.
    """

    def __init__(self, endpoint: str, token: str = "", timeout: float = 10.0) -> None:
        self.endpoint = endpoint if "://" in endpoint else f"tcp://{endpoint}"
        self._token = token
        self._timeout = timeout
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket[Any] | None = None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def _socket(self) -> zmq.Socket[Any]:
        if self._sock is None:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(self.endpoint)
            self._sock = s
        return self._sock

    def call(self, method: str, request: Any, reply_type: type[T], timeout: float | None = None) -> T:
        """Call ``method`` and decode the reply as ``reply_type``.

        Raises:
            Timeout: no reply within ``timeout`` (default: the client's).
            KVPlaneError: the server's error, re-raised by code.
        """
        t = self._timeout if timeout is None else timeout
        with self._lock:
            rid = next(self._ids)
            env = wire.Envelope(wire.WIRE_VERSION, rid, method, self._token, int(t * 1000),
                                msgspec.Raw(wire.encode(request)))
            sock = self._socket()
            sock.send(wire.encode(env))
            while True:
                if not sock.poll(int(t * 1000)):
                    self._reset()
                    raise Timeout(f"rpc {method} to {self.endpoint} timed out after {t}s")
                rep = wire.decode(sock.recv(), wire.Reply)
                if rep.id == rid:
                    break
        if rep.code:
            raise from_code(rep.code, rep.error)
        return wire.decode(rep.body, reply_type)

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def close(self) -> None:
        """Close the socket (idempotent)."""
        with self._lock:
            self._reset()

    def __enter__(self) -> "RpcClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["RpcServer", "RpcClient", "Unavailable"]
