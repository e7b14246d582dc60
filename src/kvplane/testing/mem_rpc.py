"""In-memory control RPC with the surface of :mod:`kvplane.common.rpc`, and scripted faults.

A :class:`MemRpcNetwork` holds servers by endpoint. :class:`MemRpcServer` has the surface of
``RpcServer`` (``host``, ``port``, ``add``, ``start``, ``close``, ``malformed``) and
:class:`MemRpcClient` the surface of ``RpcClient`` (``endpoint``, ``call``, ``close``), so either
can stand in for the real one (``network.client`` has ``RpcClient``'s signature). A call is
encoded as on the wire (``wire.Envelope`` / ``wire.Reply``), served by the same
``rpc.dispatch`` as the real server, and runs the handler on the calling thread: no sockets, no
threads. A call to an endpoint with no open server raises ``Unavailable``, like a refused
connection.

Faults come from ``network.plan`` (a :class:`~kvplane.testing.faults.FaultPlan`), keyed by the
endpoint and the method:

* DROP       the request is lost: the handler never runs; the client waits out its timeout
             (``network.sleep``) and raises ``Timeout``.
* DELAY      the reply comes ``seconds`` late. Past the timeout, the handler has still run (the
             server got the request) and the client raises ``Timeout`` after the timeout.
* FAIL       the server answers with the rule's error instead of running the handler; its code
             crosses the wire and is raised again on the client.
* CORRUPT    one byte of the request frame is flipped before the server reads it: a frame that
             no longer decodes is dropped as malformed (client: ``Unavailable``); one that still
             decodes is served as it reads.
* DISCONNECT the connection resets before the request arrives: ``Unavailable``.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from kvplane.common import wire
from kvplane.common.errors import ProtocolError, Timeout, Unavailable, from_code
from kvplane.common.rpc import Handler, dispatch
from kvplane.testing.faults import Fault, FaultKind, FaultPlan

T = TypeVar("T")


class MemRpcNetwork:
    """Servers by endpoint, the fault plan, and how waiting is done.

    Args:
        plan: faults to inject (default: none).
        sleep: how a client waits out a delay or a timeout (tests may pass a fake clock's).
    """

    def __init__(self, plan: FaultPlan | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.plan = plan or FaultPlan()
        self.sleep = sleep
        self.servers: dict[str, MemRpcServer] = {}
        self._ports = itertools.count(1)
        self._lock = threading.Lock()

    def server(self, token: str = "") -> MemRpcServer:
        """A new server on a fresh endpoint (``mem:N``)."""
        with self._lock:
            srv = MemRpcServer(self, "mem", next(self._ports), token)
            self.servers[srv.endpoint] = srv
        return srv

    def client(self, endpoint: str, token: str = "", timeout: float = 10.0,
               max_message: int = wire.MAX_CONTROL_FRAME) -> MemRpcClient:
        """A client of ``endpoint``; same signature as ``RpcClient`` (``max_message`` unused)."""
        return MemRpcClient(self, endpoint, token, timeout)

    def lookup(self, endpoint: str) -> MemRpcServer | None:
        srv = self.servers.get(endpoint.removeprefix("tcp://"))
        return srv if srv is not None and not srv.closed else None


class MemRpcServer:
    """One in-memory server (see the module docstring). Handlers run on the caller's thread."""

    def __init__(self, network: MemRpcNetwork, host: str, port: int, token: str = "") -> None:
        self.network = network
        self.host, self.port = host, port
        self.endpoint = f"{host}:{port}"
        self._token = token
        self._handlers: dict[str, tuple[Handler, type[Any]]] = {}
        self.malformed = 0
        self.served = 0
        self.closed = False

    def add(self, method: str, handler: Handler, request_type: type[Any]) -> None:
        """Register ``handler(request) -> reply`` for ``method``."""
        self._handlers[method] = (handler, request_type)

    def start(self) -> MemRpcServer:
        return self

    def handle(self, frame: bytes) -> bytes:
        """Serve one encoded request; returns the encoded reply.

        Raises:
            Unavailable: the frame is malformed (the real server drops the connection).
        """
        reply = dispatch(self._handlers, self._token, frame)
        if reply is None:
            self.malformed += 1
            raise Unavailable("server dropped the connection: malformed frame")
        self.served += 1
        return wire.encode(reply)

    def close(self) -> None:
        """Stop serving: later calls are refused (idempotent)."""
        self.closed = True

    def __enter__(self) -> MemRpcServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MemRpcClient:
    """A client with ``RpcClient``'s surface. Thread-safe (calls are serialised)."""

    def __init__(self, network: MemRpcNetwork, endpoint: str, token: str = "",
                 timeout: float = 10.0) -> None:
        self.network = network
        self.endpoint = endpoint.removeprefix("tcp://")
        self._token = token
        self._timeout = timeout
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.calls = 0

    def call(self, method: str, request: Any, reply_type: type[T], timeout: float | None = None,
             meanwhile: Callable[[], None] | None = None) -> T:
        """Call ``method`` and decode the reply as ``reply_type`` (``meanwhile`` runs once the
        request reached a server, before the reply is taken, as in ``RpcClient.call``).

        Raises:
            Timeout: no reply within ``timeout`` (default: the client's).
            Unavailable: no server at the endpoint, or the connection failed.
            KVPlaneError: the server's error, raised again by code.
        """
        seconds = self._timeout if timeout is None else timeout
        with self._lock:
            self.calls += 1
            rid = next(self._ids)
            env = wire.Envelope(wire.WIRE_VERSION, rid, method, self._token, int(seconds * 1000),
                                msgspec.Raw(wire.encode(request)))
            try:
                rep = self._exchange(method, wire.encode(env), seconds, meanwhile)
                if rep.id != rid:
                    raise ProtocolError(f"reply id {rep.id} != request id {rid}")
            except TimeoutError as exc:
                raise Timeout(f"rpc {method} to {self.endpoint} timed out after {seconds}s") from exc
            except (Unavailable, ProtocolError) as exc:
                raise Unavailable(f"rpc {method} to {self.endpoint} failed: {exc}") from exc
        if rep.code:
            raise from_code(rep.code, rep.error)
        return wire.decode(rep.body, reply_type)

    def _exchange(self, method: str, frame: bytes, seconds: float,
                  meanwhile: Callable[[], None] | None = None) -> wire.Reply:
        """Deliver one request through the fault plan; the decoded reply."""
        srv = self.network.lookup(self.endpoint)
        if srv is None:
            raise Unavailable(f"cannot reach {self.endpoint}: connection refused")
        if meanwhile is not None:
            meanwhile()
        fault = self.network.plan.decide(self.endpoint, method)
        if fault is None:
            return wire.decode(srv.handle(frame), wire.Reply)
        return self._faulty_exchange(srv, fault, frame, seconds)

    def _faulty_exchange(self, srv: MemRpcServer, fault: Fault, frame: bytes,
                         seconds: float) -> wire.Reply:
        if fault.kind is FaultKind.DISCONNECT:
            raise Unavailable("connection reset by peer")
        if fault.kind is FaultKind.DROP:
            self.network.sleep(seconds)
            raise TimeoutError("request lost")
        if fault.kind is FaultKind.FAIL:
            error = fault.error(f"injected failure of {fault.op} at {fault.peer}")
            env = wire.decode(frame, wire.Envelope)
            return wire.Reply(env.id, error.code, str(error), msgspec.Raw(wire.encode(None)))
        if fault.kind is FaultKind.CORRUPT:
            damaged = bytearray(frame)
            fault.flip(damaged)
            return wire.decode(srv.handle(bytes(damaged)), wire.Reply)
        reply = srv.handle(frame)  # DELAY: the server answers, the reply is late
        if fault.seconds >= seconds:
            self.network.sleep(seconds)
            raise TimeoutError("reply too late")
        self.network.sleep(fault.seconds)
        return wire.decode(reply, wire.Reply)

    def close(self) -> None:
        """Nothing to release; kept for the RpcClient surface."""

    def __enter__(self) -> MemRpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

