"""One TCP data connection: pipelined frames from registered memory into the socket and back.

Owns :class:`Conn` (one connected socket, its request ids and the frame exchanges: READ,
WRITE, READV, WRITEV, the simple calls) and :class:`Broken` (a connection that died, with the
slices it did not finish). Bytes go ``sendmsg([header, view_of_registered_memory])`` out and
``recv_into(view)`` in: no intermediate copies in Python. Imports the wire protocol and the
batch records; never the engine, nor the pool and transport in ``tcp``.
"""

from __future__ import annotations

import collections
import socket
import struct
from collections.abc import Callable, Iterable

import msgspec

from kvplane.common import local
from kvplane.common.deadline import Deadline
from kvplane.common.errors import KVPlaneError, ProtocolError, Timeout, Unavailable, from_code
from kvplane.transfer import protocol
from kvplane.transfer.batch import Slice
from kvplane.transfer.types import OpCode, TransferStatus

WINDOW = 64  # most frames in flight on one connection
READV_WINDOW = 4  # READV frames in flight on one connection
READV_BYTES = 16 << 20  # most payload bytes asked in one READV frame
_TCP_ONLY: set[tuple[str, int]] = set()  # peers that refused OP_LOCAL (older listeners)


class Broken(Exception):
    """The connection died; ``left`` are the slices that did not finish."""

    def __init__(self, left: list[Slice], cause: BaseException) -> None:
        super().__init__(str(cause))
        self.left = left


class _InFlight:
    """Where one ``Conn.execute`` call stands.

    ``slices[:sent]`` have been sent; ``awaiting`` holds those whose answer has not been read
    yet, oldest first, with their request ids; ``reads_awaiting`` counts the READs among them.
    """

    __slots__ = ("slices", "sent", "awaiting", "reads_awaiting")

    def __init__(self, slices: list[Slice]) -> None:
        self.slices = slices
        self.sent = 0
        self.awaiting: collections.deque[tuple[Slice, int]] = collections.deque()
        self.reads_awaiting = 0

    def finished(self) -> bool:
        return self.sent == len(self.slices) and not self.awaiting

    def unfinished(self) -> list[Slice]:
        """Awaiting slices, then the ones never sent."""
        return [s for s, _ in self.awaiting] + self.slices[self.sent:]


class Conn:
    """One data connection to a peer, over a connected blocking socket. One thread at a time.

    Args:
        sock: the connected socket (blocking; deadlines are kernel timeouts, see set_timeout).
        peer: (host, port) it is connected to (the pool key).
    """

    def __init__(self, sock: socket.socket, peer: tuple[str, int], readv: bool = True) -> None:
        self.sock = sock
        self.peer = peer
        self.readv = readv  # several READs go as READV frames (False: one READ frame each)
        self._timeout = -1.0
        self._rid = 0
        self._hdr = bytearray(protocol.RESP.size)
        self._hview = memoryview(self._hdr)
        self.alive = True

    @classmethod
    def open(cls, host: str, port: int, token: str, timeout: float) -> Conn:
        """Connect to ``host:port`` and, when ``token`` is set, say HELLO with it; a listener
        on this host is then reached over its Unix socket (:mod:`kvplane.common.local`).

        Raises:
            Unavailable: the peer cannot be reached or the handshake failed.
            Unauthorized: the peer rejected the token.
        """
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise Unavailable(f"cannot connect to {host}:{port}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)  # blocking; deadlines are kernel timeouts (set_timeout)
        conn = cls(sock, (host, port))
        if (host, port) in _TCP_ONLY or not local.same_host(sock):
            if token:
                conn.hello(token, timeout)
            return conn
        # HELLO and OP_LOCAL in one send, one round trip: the listener answers OP_LOCAL only
        # once HELLO was accepted (frames are served in order), and HELLO is answered first
        rid = conn.send_after_hello(token, protocol.OP_LOCAL, timeout) if token else 0
        try:
            body = (conn.answer(rid, 4096) if token
                    else conn.call(protocol.OP_LOCAL, 0, b"", timeout, 4096))
            info = msgspec.msgpack.decode(body, type=local.LocalInfo)
        except TimeoutError as exc:  # a stalled peer: as a stalled HELLO
            conn.close()
            raise Timeout(f"handshake with {host}:{port} timed out after {timeout}s") from exc
        except ProtocolError as exc:  # an answer out of step: a broken peer, as in HELLO
            conn.close()
            raise Unavailable(f"handshake with {host}:{port} failed: {exc}") from exc
        except (OSError, KVPlaneError, msgspec.DecodeError, msgspec.ValidationError):
            _TCP_ONLY.add((host, port))  # an older listener closes on an unknown op: again
            conn.close()
            return cls.open(host, port, token, timeout)
        unix = local.connect(info, sock, timeout)
        if unix is None:
            return conn
        moved = cls(unix, (host, port))
        if token:
            moved.hello(token, timeout)
        conn.close()
        return moved

    def hello(self, token: str, timeout: float) -> None:
        """Present ``token`` (closes the connection if the handshake fails)."""
        self._handshake(lambda: self.call(protocol.OP_HELLO, 0, token.encode(), timeout),
                        timeout)

    def send_after_hello(self, token: str, op: int, timeout: float) -> int:
        """Send HELLO with ``token`` and a simple request ``op`` (no payload) in one send, read
        HELLO's answer (failing as :meth:`hello` does) and return ``op``'s request id for
        :meth:`answer`."""
        payload = token.encode()
        hid = self.next_id()
        rid = self.next_id()
        self.set_timeout(Deadline.after(timeout))
        frames: list[bytes | memoryview] = [
            protocol.pack_req(protocol.OP_HELLO, hid, 0, len(payload)), payload,
            protocol.pack_req(op, rid, 0, 0)]

        def both() -> None:
            protocol.send_all(self.sock, frames)
            self.answer(hid, protocol.MAX_ERROR)
        self._handshake(both, timeout)
        return rid

    def _handshake(self, step: Callable[[], object], timeout: float) -> None:
        """Run a step of the handshake: a stalled peer is a Timeout, a broken one Unavailable,
        and the connection is closed on any failure."""
        host, port = self.peer
        try:
            step()
        except TimeoutError as exc:  # a stalled peer is a timeout, not a failure
            self.close()
            raise Timeout(f"handshake with {host}:{port} timed out after {timeout}s") from exc
        except (OSError, ProtocolError) as exc:
            self.close()
            raise Unavailable(f"handshake with {host}:{port} failed: {exc}") from exc
        except BaseException:
            self.close()
            raise

    def set_timeout(self, deadline: Deadline) -> None:
        """Bound the next socket calls by ``deadline`` (re-armed only when it shrank by 10 %)."""
        left = deadline.remaining()
        if left < self._timeout * 0.9 or self._timeout < 0 or left > self._timeout:
            protocol.set_io_timeout(self.sock, left)
            self._timeout = max(left, 1e-3)

    def next_id(self) -> int:
        self._rid += 1
        return self._rid

    def read_resp(self, expect: int) -> tuple[int, int]:
        """Receive a response header for request ``expect``; returns (status, length)."""
        got = protocol.recv_spin(self.sock, self._hview)
        if got == 0:
            raise Unavailable("connection closed by peer")
        if got < protocol.RESP.size:
            protocol.recv_exact(self.sock, self._hview[got:])
        magic, status, rid, length = protocol.RESP.unpack(self._hdr)
        protocol.check_resp_magic(magic)
        if rid != expect:
            raise ProtocolError(f"response id {rid} != request id {expect}")
        return status, length

    def read_error(self, status: int, length: int) -> KVPlaneError:
        """Consume an error body and build the exception."""
        if length > protocol.MAX_ERROR:
            raise ProtocolError("error message too long")
        msg = bytearray(length)
        protocol.recv_exact(self.sock, memoryview(msg))
        return from_code(status, msg.decode(errors="replace"))

    def call(self, op: int, addr: int, payload: bytes, timeout: float, limit: int = 1 << 20) -> bytes:
        """A simple request/response (HELLO, DESCRIBE, PING); returns the response body."""
        rid = self.next_id()
        self.set_timeout(Deadline.after(timeout))
        protocol.send_all(self.sock, [protocol.pack_req(op, rid, addr, len(payload)), payload])
        return self.answer(rid, limit)

    def answer(self, rid: int, limit: int = 1 << 20) -> bytes:
        """The body of the answer to simple request ``rid`` (raises its error)."""
        status, length = self.read_resp(rid)
        if status:
            raise self.read_error(status, length)
        if length > limit:
            raise ProtocolError(f"response of {length} bytes exceeds {limit}")
        body = bytearray(length)
        protocol.recv_exact(self.sock, memoryview(body))
        return bytes(body)

    def close(self) -> None:
        self.alive = False
        try:
            self.sock.close()
        except OSError:
            pass

    def execute(self, slices: list[Slice], deadline: Deadline) -> None:
        """Run ``slices`` pipelined, finishing each through ``slice.done``.

        Only READs (more than one): READV frames, each all or nothing on a broken connection.
        A passed deadline finishes every unfinished slice as TIMEOUT (and closes the
        connection); an error answer finishes just that slice as FAILED.

        Raises:
            Broken: the connection died; it carries the slices that did not finish, in order.
        """
        if self.readv and len(slices) > 1 and all(s.op == OpCode.READ for s in slices):
            self._execute_readv(slices, deadline)
            return
        flight = _InFlight(slices)
        self.set_timeout(deadline)
        try:
            while not flight.finished():
                self._send_more(flight)
                self._receive_next(flight, deadline)
        except TimeoutError:
            self.close()
            for s in flight.unfinished():
                s.done(TransferStatus.TIMEOUT, "deadline passed waiting for the peer")
        except (OSError, Unavailable, ProtocolError) as exc:
            self.close()
            raise Broken(flight.unfinished(), exc) from exc

    def _execute_readv(self, slices: list[Slice], deadline: Deadline) -> None:
        """Only READs: up to ``MAX_READV`` per READV frame, ``READV_WINDOW`` frames in flight;
        each answer lands straight in the slices' buffers (one scatter receive per frame)."""
        groups = readv_groups(slices)
        waiting: collections.deque[tuple[list[Slice], int]] = collections.deque()
        sent = 0
        self.set_timeout(deadline)
        try:
            while sent < len(groups) or waiting:
                while sent < len(groups) and len(waiting) < READV_WINDOW:
                    waiting.append((groups[sent], self._send_readv(groups[sent])))
                    sent += 1
                if deadline.expired():
                    raise TimeoutError("deadline passed")
                self.set_timeout(deadline)
                self._receive_readv(*waiting[0])
                waiting.popleft()
        except TimeoutError:
            self.close()
            for s in [s for g, _ in waiting for s in g] + [s for g in groups[sent:] for s in g]:
                s.done(TransferStatus.TIMEOUT, "deadline passed waiting for the peer")
        except (OSError, Unavailable, ProtocolError) as exc:
            self.close()
            left = [s for g, _ in waiting for s in g] + [s for g in groups[sent:] for s in g]
            raise Broken(left, exc) from exc

    def _send_readv(self, group: list[Slice]) -> int:
        return self.send_readv(b"".join(protocol.READV_ENTRY.pack(s.remote, s.length, s.task.req.gen)
                                        for s in group), len(group))

    def send_readv(self, table: bytes, count: int) -> int:
        """Send one READV frame of ``count`` packed ``READV_ENTRY`` rows; returns its id."""
        rid = self.next_id()
        protocol.send_all(self.sock, [protocol.pack_req(protocol.OP_READV, rid, count, len(table)),
                                      table])
        return rid

    def receive_readv(self, rid: int, views: Iterable[memoryview], lengths: list[int],
                      whole: list[memoryview] | None = None) -> tuple[list[int], str]:
        """Receive the answer to READV ``rid``: the entries that succeeded land in their
        ``views`` (``whole``, when given, holds every entry's bytes in order in fewer
        buffers: it is used when every entry succeeded). Returns per entry 0 or the peer's
        error code, and the peer's message when it refused the whole frame (every code is
        then its status).

        Raises:
            TimeoutError, OSError, Unavailable, ProtocolError: the connection is unusable.
        """
        status, length = self.read_resp(rid)
        if status:  # the whole frame was refused
            return [status] * len(lengths), str(self.read_error(status, length))
        raw = bytearray(4 * len(lengths))
        protocol.recv_exact(self.sock, memoryview(raw))
        codes = list(struct.unpack(f"<{len(lengths)}i", raw))
        if any(codes):
            lengths = [n for n, c in zip(lengths, codes) if c == 0]
            bufs = [v for v, c in zip(views, codes) if c == 0]
        else:
            bufs = whole if whole is not None else list(views)
        if length != sum(lengths):
            raise ProtocolError(f"READV returned {length} bytes for the entries that succeeded")
        protocol.recv_scatter(self.sock, bufs)
        return codes, ""

    def receive_one(self, rid: int, view: memoryview | None) -> tuple[list[int], str]:
        """Receive the answer to one READ (its bytes land in ``view``) or WRITE (``view``
        None), in :meth:`receive_codes`' shape: ``([0], "")`` or ``([code], message)``."""
        status, length = self.read_resp(rid)
        if status:
            return [status], str(self.read_error(status, length))
        if length != (0 if view is None else len(view)):
            raise ProtocolError(f"answer of {length} bytes to request {rid}")
        if view is not None:
            protocol.recv_exact(self.sock, view)
        return [0], ""

    def receive_codes(self, rid: int, count: int) -> tuple[list[int], str]:
        """Receive the answer to WRITEV ``rid``: per entry 0 or the peer's error code, and the
        peer's message when it refused the whole frame (every code is then its status)."""
        status, length = self.read_resp(rid)
        if status:
            return [status] * count, str(self.read_error(status, length))
        if length != 4 * count:
            raise ProtocolError(f"WRITEV answered {length} bytes of codes for {count} entries")
        raw = bytearray(length)
        protocol.recv_exact(self.sock, memoryview(raw))
        return list(struct.unpack(f"<{count}i", raw)), ""

    def _receive_readv(self, group: list[Slice], rid: int) -> None:
        codes, whole = self.receive_readv(rid, [s.local for s in group], [s.length for s in group])
        for s, code in zip(group, codes):
            if whole:
                s.done(TransferStatus.FAILED, whole)
            elif code:
                s.done(TransferStatus.FAILED, refused(code))
            else:
                s.done(TransferStatus.COMPLETED)

    def _send_more(self, flight: _InFlight) -> None:
        """Send requests until the window is full or the next WRITE has to wait.

        READ headers are coalesced into one send. A WRITE goes only when no READ is awaiting
        its answer, so neither side can block sending while the other blocks sending.
        """
        read_headers: list[bytes] = []
        while flight.sent < len(flight.slices) and len(flight.awaiting) < WINDOW:
            s = flight.slices[flight.sent]
            if s.op == OpCode.WRITE:
                if flight.reads_awaiting or read_headers:
                    break
                rid = self.next_id()
                protocol.send_all(self.sock, [protocol.pack_req(protocol.OP_WRITE, rid, s.remote,
                                                                s.length, s.task.req.gen), s.local])
            else:
                rid = self.next_id()
                read_headers.append(protocol.pack_req(protocol.OP_READ, rid, s.remote, s.length,
                                                      s.task.req.gen))
                flight.reads_awaiting += 1
            flight.awaiting.append((s, rid))
            flight.sent += 1
        if read_headers:
            protocol.send_all(self.sock, [b"".join(read_headers)])

    def _receive_next(self, flight: _InFlight, deadline: Deadline) -> None:
        """Read the answer to the oldest awaiting request and finish its slice."""
        s, rid = flight.awaiting[0]
        if deadline.expired():
            raise TimeoutError("deadline passed")
        self.set_timeout(deadline)
        status, length = self.read_resp(rid)
        if status:
            s.done(TransferStatus.FAILED, str(self.read_error(status, length)))
        elif s.op == OpCode.READ:
            if length != s.length:
                raise ProtocolError(f"READ returned {length} bytes, asked {s.length}")
            protocol.recv_exact(self.sock, s.local)
            s.done(TransferStatus.COMPLETED)
        else:
            s.done(TransferStatus.COMPLETED)
        flight.awaiting.popleft()
        if s.op == OpCode.READ:
            flight.reads_awaiting -= 1


def refused(code: int, op: str = "READ") -> str:
    """The message of an entry the peer refused with error ``code``."""
    return f"{op} refused by the peer: {type(from_code(code, '')).__name__} ({code})"


def frames(lengths: list[int]) -> list[tuple[int, int]]:
    """[start, end) index ranges of consecutive entries cut into READV frames (at most
    MAX_READV entries and READV_BYTES each; an entry larger than that goes alone)."""
    if len(lengths) <= protocol.MAX_READV and sum(lengths) <= READV_BYTES:
        return [(0, len(lengths))] if lengths else []
    out: list[tuple[int, int]] = []
    start, size = 0, 0
    for i, n in enumerate(lengths):
        if i > start and (i - start >= protocol.MAX_READV or size + n > READV_BYTES):
            out.append((start, i))
            start, size = i, 0
        size += n
    if start < len(lengths):
        out.append((start, len(lengths)))
    return out


def readv_groups(slices: list[Slice]) -> list[list[Slice]]:
    """Consecutive slices cut into READV frames of at most MAX_READV entries and READV_BYTES."""
    return [slices[a:b] for a, b in frames([s.length for s in slices])]


def finish(slices: list[Slice], status: TransferStatus, error: str) -> None:
    """End every slice of ``slices`` with ``status`` and ``error``."""
    for s in slices:
        s.done(status, error)
