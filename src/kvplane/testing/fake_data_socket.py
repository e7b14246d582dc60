"""An in-memory stand-in for a TCP connection to a transfer engine's data listener.

:class:`FakeDataPeer` is the far side: a bytearray of "registered memory" at ``base`` that
answers the data protocol of :mod:`kvplane.transfer.protocol` (HELLO, DESCRIBE, PING, READ,
READV, WRITE, WRITEV) the moment a request is complete. :meth:`FakeDataPeer.connect` hands out
:class:`FakeDataSocket` objects, which implement just what ``transports.tcp.Conn`` calls on a
socket (``sendmsg``, ``recv_into`` with ``MSG_DONTWAIT``/``MSG_WAITALL``, ``recvmsg_into``,
``setsockopt`` for the kernel timeouts, ``close``). No file descriptors, no threads.

Faults come from a :class:`~kvplane.testing.faults.FaultPlan`, keyed by the peer's ``name`` and
the request's op name (``"read"``, ``"write"``, ``"hello"``, ``"describe"``, ``"ping"``; each
entry of a READV is decided as a ``"read"`` and each of a WRITEV as a ``"write"``, and a DROP,
DISCONNECT, DELAY or CORRUPT of one entry applies to the whole answer):

* DROP       the peer stalls: this request and every later one on the connection go unanswered,
             so a receive blocks for the armed kernel timeout and then fails like one.
* DELAY      the response becomes readable ``seconds`` later.
* FAIL       the response carries the rule's error code; a WRITE's payload is not applied.
* CORRUPT    one byte of the response (header or body) is flipped (``at=0`` hits the magic).
* DISCONNECT the peer closes: responses already sent stay readable, then EOF; sends fail.

Partial I/O can be forced with ``send_chunk``/``recv_chunk`` (bytes accepted per ``sendmsg``,
returned per ``recv_into``).
"""

from __future__ import annotations

import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvplane.common.errors import AddressNotRegistered, KVPlaneError, Unauthorized
from kvplane.testing.faults import Fault, FaultKind, FaultPlan
from kvplane.transfer import protocol

_TIMEVAL = struct.Struct("ll")


@dataclass
class _Outgoing:
    """Response bytes and the monotonic time they become readable."""

    data: bytearray
    ready_at: float


class FakeDataPeer:
    """The far end of fake data connections: memory plus the protocol's server side.

    Args:
        name: peer name the fault plan matches on.
        size: bytes of memory, starting at address ``base``.
        plan: faults to inject (default: none).
        base: the address of the first byte.
        token: the HELLO token required when not empty.
        descriptor: the body DESCRIBE answers with.
        send_chunk: most bytes one ``sendmsg`` accepts (0: all).
        recv_chunk: most bytes one ``recv_into`` returns (0: all available).
        sleep: how waiting is done (tests may pass a fake).
    """

    def __init__(self, name: str = "peer", size: int = 1 << 20, plan: FaultPlan | None = None,
                 base: int = 0x10000, token: str = "", descriptor: bytes = b"{}",
                 send_chunk: int = 0, recv_chunk: int = 0,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.name = name
        self.memory = bytearray(size)
        self.plan = plan or FaultPlan()
        self.base = base
        self.token = token.encode()
        self.descriptor = descriptor
        self.send_chunk = send_chunk
        self.recv_chunk = recv_chunk
        self.sleep = sleep
        self.sockets: list[FakeDataSocket] = []
        self.served: list[tuple[str, int, int]] = []  # (op, addr, length) answered without fault
        self.arrivals: list[tuple[str, int]] = []  # (op, responses still unread when it arrived)

    def connect(self) -> FakeDataSocket:
        """A new connection to this peer."""
        sock = FakeDataSocket(self)
        self.sockets.append(sock)
        return sock

    def view(self, addr: int, length: int) -> memoryview:
        """The peer's memory at ``addr`` (raises AddressNotRegistered outside it)."""
        start = addr - self.base
        if start < 0 or length < 0 or start + length > len(self.memory):
            raise AddressNotRegistered(f"range {addr:#x}+{length} is not registered")
        return memoryview(self.memory)[start:start + length]

    def answer(self, op: int, addr: int, length: int, body: bytes) -> bytes:
        """Serve one request without faults; returns the response body.

        Raises:
            KVPlaneError: what the real server would answer with an error status.
        """
        if op == protocol.OP_READ:
            return bytes(self.view(addr, length))
        if op == protocol.OP_WRITE:
            self.view(addr, len(body))[:] = body
            return b""
        if op == protocol.OP_HELLO:
            if self.token and bytes(body) != self.token:
                raise Unauthorized("bad token")
            return b""
        if op == protocol.OP_DESCRIBE:
            return self.descriptor
        return b""


class FakeDataSocket:
    """One fake connection (see the module docstring). Not thread-safe, like ``Conn``."""

    def __init__(self, peer: FakeDataPeer) -> None:
        self.peer = peer
        self.timeout = 0.0  # armed kernel timeout (SO_RCVTIMEO); 0 = block forever
        self.closed = False
        self.stalled = False
        self.hung_up = False
        self._inbox = bytearray()
        self._outbox: deque[_Outgoing] = deque()

    # -- the socket surface Conn uses ------------------------------------------------------------
    def setsockopt(self, level: int, option: int, value: int | bytes) -> None:
        if level == socket.SOL_SOCKET and option == socket.SO_RCVTIMEO:
            sec, usec = _TIMEVAL.unpack(value)  # type: ignore[arg-type]  # SO_RCVTIMEO takes a packed timeval
            self.timeout = sec + usec / 1e6

    def settimeout(self, value: float | None) -> None:
        """Accepted and ignored: Conn uses kernel timeouts (setsockopt)."""

    def close(self) -> None:
        self.closed = True

    def sendmsg(self, buffers: Sequence[bytes | memoryview]) -> int:
        self._check_open()
        if self.hung_up:
            raise ConnectionResetError("peer closed the connection")
        data = b"".join(bytes(b) for b in buffers)
        if self.peer.send_chunk:
            data = data[:self.peer.send_chunk]
        self._inbox += data
        self._serve()
        return len(data)

    def recv_into(self, view: memoryview, nbytes: int = 0, flags: int = 0) -> int:
        self._check_open()
        want = min(nbytes or len(view), self.peer.recv_chunk or len(view))
        if not self._readable():
            if self.hung_up and not self._outbox:
                return 0
            if flags & socket.MSG_DONTWAIT:
                raise BlockingIOError("no data")
            self._wait_for_data()
        head = self._outbox[0]
        n = min(want, len(head.data))
        view[:n] = head.data[:n]
        del head.data[:n]
        if not head.data:
            self._outbox.popleft()
        return n

    def recvmsg_into(self, buffers: Sequence[memoryview], ancbufsize: int = 0,
                     flags: int = 0) -> tuple[int, list, int, None]:
        """Scatter receive: like ``recv_into`` into the buffers in order (one chunk at most)."""
        total = 0
        for buf in buffers:
            if total and not self._readable():
                break
            n = self.recv_into(memoryview(buf), len(buf), flags if not total else socket.MSG_DONTWAIT)
            total += n
            if n < len(buf) or self.peer.recv_chunk:
                break
        return total, [], 0, None

    # -- internals -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise OSError(9, "Bad file descriptor")

    def _readable(self) -> bool:
        return bool(self._outbox) and self._outbox[0].ready_at <= time.monotonic()

    def _wait_for_data(self) -> None:
        """Block like a kernel receive: until data is due, or fail after the armed timeout."""
        due = self._outbox[0].ready_at - time.monotonic() if self._outbox else None
        if due is not None and (self.timeout <= 0 or due <= self.timeout):
            self.peer.sleep(max(due, 0.0))
            return
        if self.hung_up:
            return
        self.peer.sleep(self.timeout)
        raise BlockingIOError("receive timed out")

    def _serve(self) -> None:
        """Answer every complete request in the inbox, in order."""
        while not (self.stalled or self.hung_up) and len(self._inbox) >= protocol.REQ.size:
            magic, version, op, _flags, rid, addr, length, _gen = protocol.REQ.unpack_from(self._inbox)
            if magic != protocol.MAGIC or version != protocol.VERSION or op not in protocol.OPS:
                self.hung_up = True  # the real server closes the connection on a bad frame
                return
            carries_body = op in (protocol.OP_WRITE, protocol.OP_HELLO, protocol.OP_READV,
                                  protocol.OP_WRITEV)
            total = protocol.REQ.size + (length if carries_body else 0)
            if len(self._inbox) < total:
                return
            body = bytes(self._inbox[protocol.REQ.size:total])
            del self._inbox[:total]
            self._answer(op, rid, addr, length, body)

    def _answer(self, op: int, rid: int, addr: int, length: int, body: bytes) -> None:
        self.peer.arrivals.append((protocol.OPS[op], len(self._outbox)))
        if op == protocol.OP_READV:
            self._answer_readv(rid, body)
            return
        if op == protocol.OP_WRITEV:
            self._answer_writev(rid, addr, body)
            return
        fault = self.peer.plan.decide(self.peer.name, protocol.OPS[op])
        if fault is not None and fault.kind is FaultKind.DROP:
            self.stalled = True
            return
        if fault is not None and fault.kind is FaultKind.DISCONNECT:
            self.hung_up = True
            return
        response = self._response(op, rid, addr, length, body, fault)
        ready_at = time.monotonic()
        if fault is not None and fault.kind is FaultKind.DELAY:
            ready_at += fault.seconds
        if fault is not None and fault.kind is FaultKind.CORRUPT:
            fault.flip(response)
        self._outbox.append(_Outgoing(response, ready_at))

    def _answer_readv(self, rid: int, table: bytes) -> None:
        """Each entry served (and faulted) like a READ; one answer for the frame."""
        entries = [(addr, length, b"") for addr, length, _ in protocol.READV_ENTRY.iter_unpack(table)]
        self._answer_entries(rid, protocol.OP_READ, entries)

    def _answer_writev(self, rid: int, count: int, body: bytes) -> None:
        """Each entry applied (and faulted) like a WRITE; one answer of codes for the frame."""
        at = count * protocol.READV_ENTRY.size
        entries = []
        for addr, length, _gen in protocol.READV_ENTRY.iter_unpack(body[:at]):
            entries.append((addr, length, body[at:at + length]))
            at += length
        self._answer_entries(rid, protocol.OP_WRITE, entries)

    def _answer_entries(self, rid: int, op: int, entries: list[tuple[int, int, bytes]]) -> None:
        """READV (``op`` READ: codes, then the payloads read) or WRITEV (WRITE: the codes),
        each entry decided by the fault plan as one request of ``op``."""
        name = protocol.OPS[op]
        codes, parts, ready_at, flips, served = [], [], time.monotonic(), [], []
        for addr, length, body in entries:
            fault = self.peer.plan.decide(self.peer.name, name)
            kind = fault.kind if fault is not None else None
            if kind is FaultKind.DROP:
                self.stalled = True
                return
            if kind is FaultKind.DISCONNECT:
                self.hung_up = True
                return
            try:
                if fault is not None and kind is FaultKind.FAIL:
                    raise fault.error(f"injected failure of {name} at {addr:#x}")
                parts.append(self.peer.answer(op, addr, length, body))
                codes.append(0)
                served.append((name, addr, length))
            except KVPlaneError as exc:
                codes.append(exc.code)
            if fault is not None and kind is FaultKind.DELAY:
                ready_at += fault.seconds
            if fault is not None and kind is FaultKind.CORRUPT:
                flips.append(fault)
        payload = b"".join(parts)  # WRITE answers carry none
        head = len(payload) if op == protocol.OP_READ else 4 * len(codes)
        response = bytearray(protocol.pack_resp(0, rid, head)
                             + struct.pack(f"<{len(codes)}i", *codes) + payload)
        for flip in flips:
            flip.flip(response)
        self.peer.served.extend(served)
        self._outbox.append(_Outgoing(response, ready_at))

    def _response(self, op: int, rid: int, addr: int, length: int, body: bytes,
                  fault: Fault | None) -> bytearray:
        try:
            if fault is not None and fault.kind is FaultKind.FAIL:
                raise fault.error(f"injected failure of {protocol.OPS[op]} at {addr:#x}")
            payload = self.peer.answer(op, addr, length, body)
        except KVPlaneError as exc:
            message = str(exc).encode()
            return bytearray(protocol.pack_resp(exc.code, rid, len(message)) + message)
        self.peer.served.append((protocol.OPS[op], addr, length))
        return bytearray(protocol.pack_resp(0, rid, len(payload)) + payload)
