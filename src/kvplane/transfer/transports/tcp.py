"""TCP transport: pipelined frames from registered memory straight into the socket and back.

Bytes go ``sendmsg([header, view_of_registered_memory])`` out and ``recv_into(view)`` in:
no intermediate copies in Python. Connections are pooled per peer; a batch of several slices
is striped over up to ``streams`` connections (the first runs on the calling thread). A slice
whose connection breaks is retried on a fresh one; a passed deadline turns what is left into
TIMEOUT.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import operator
import socket
import struct
import threading
from collections.abc import Iterable, Iterator

from kvplane.common import metrics
from kvplane.common.deadline import Deadline
from kvplane.common.errors import KVPlaneError, ProtocolError, Timeout, Unavailable, from_code
from kvplane.transfer import protocol
from kvplane.transfer.batch import Slice
from kvplane.transfer.transports.base import Capabilities, Route, Transport, TransportContext
from kvplane.transfer.types import OpCode, TransferStatus

WINDOW = 64  # most frames in flight on one connection
READV_WINDOW = 4  # READV frames in flight on one connection
READV_BYTES = 16 << 20  # most payload bytes asked in one READV frame
STRIPE_MIN = 512 << 10  # batches smaller than this stay on one connection
STRIPE_SLICE_MIN = 64 << 10  # and so do batches of smaller slices (READV moves them in one frame;
# helper lanes would only contend for the GIL)
MAX_IDLE = 16  # pooled idle connections per peer


class _Broken(Exception):
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
    def open(cls, host: str, port: int, token: str, timeout: float) -> "Conn":
        """Connect to ``host:port`` and, when ``token`` is set, say HELLO with it.

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
        if token:
            conn.hello(token, timeout)
        return conn

    def hello(self, token: str, timeout: float) -> None:
        """Present ``token`` (closes the connection if the handshake fails)."""
        host, port = self.peer
        try:
            self.call(protocol.OP_HELLO, 0, token.encode(), timeout)
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
            _Broken: the connection died; it carries the slices that did not finish, in order.
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
            raise _Broken(flight.unfinished(), exc) from exc

    def _execute_readv(self, slices: list[Slice], deadline: Deadline) -> None:
        """Only READs: up to ``MAX_READV`` per READV frame, ``READV_WINDOW`` frames in flight;
        each answer lands straight in the slices' buffers (one scatter receive per frame)."""
        groups = _readv_groups(slices)
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
            raise _Broken(left, exc) from exc

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
            return [status] * len(views), str(self.read_error(status, length))
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
        codes, refused = self.receive_readv(rid, [s.local for s in group], [s.length for s in group])
        for s, code in zip(group, codes):
            if refused:
                s.done(TransferStatus.FAILED, refused)
            elif code:
                s.done(TransferStatus.FAILED, _refused(code))
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


class TcpTransport(Transport):
    """Pipelined, pooled, striped TCP to any peer's data listener."""

    name = "tcp"
    capabilities = Capabilities(same_host_only=False, priority=1)

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self._idle: dict[tuple[str, int], list[Conn]] = {}
        self._lock = threading.Lock()
        self._lanes = cf.ThreadPoolExecutor(max(1, ctx.streams * 4), thread_name_prefix="te-tcp-lane")
        self._closed = False

    def can_reach(self, route: Route) -> bool:
        return route.segment.port > 0

    # -- pool ------------------------------------------------------------------------------
    def _acquire(self, peer: tuple[str, int], deadline: Deadline) -> Conn:
        with self._lock:
            idle = self._idle.get(peer)
            if idle:
                return idle.pop()
        return self._connect(peer, min(self.ctx.connect_timeout, max(deadline.remaining(), 1e-3)))

    def _connect(self, peer: tuple[str, int], timeout: float) -> Conn:
        """A new connection to ``peer`` (tests override this to hand out fake sockets)."""
        return Conn.open(peer[0], peer[1], self.ctx.token, timeout)

    def _release(self, conn: Conn) -> None:
        if not conn.alive or self._closed:
            conn.close()
            return
        with self._lock:
            idle = self._idle.setdefault(conn.peer, [])
            if len(idle) < MAX_IDLE:
                idle.append(conn)
                return
        conn.close()

    def drop_peer(self, peer: tuple[str, int]) -> None:
        """Close every idle connection to ``peer`` (after it restarted or died)."""
        with self._lock:
            conns = self._idle.pop(peer, [])
        for c in conns:
            c.close()

    # -- data path -------------------------------------------------------------------------
    def run(self, route: Route, slices: list[Slice], deadline: Deadline) -> None:
        peer = (route.segment.host, route.segment.port)
        lanes = 1
        if len(slices) > 1 and self.ctx.streams > 1:
            total = sum(s.length for s in slices)
            if total >= STRIPE_MIN and total >= STRIPE_SLICE_MIN * len(slices):
                lanes = min(self.ctx.streams, len(slices))
        if lanes == 1:
            self._lane(peer, slices, deadline)
            return
        futs = [self._lanes.submit(self._lane, peer, slices[k::lanes], deadline)
                for k in range(1, lanes)]
        self._lane(peer, slices[0::lanes], deadline)
        cf.wait(futs)

    def _lane(self, peer: tuple[str, int], slices: list[Slice], deadline: Deadline) -> None:
        """Run ``slices`` over one connection at a time.

        When a connection breaks, its unfinished slices go again on a fresh connection (and
        the peer's idle connections are dropped: they are suspect too), up to ``ctx.retries``
        times and never past the deadline.
        """
        attempts_left = self.ctx.retries + 1
        while slices:
            try:
                conn = self._acquire(peer, deadline)
            except KVPlaneError as exc:
                timed_out = isinstance(exc, Timeout) or deadline.expired()
                _finish(slices, TransferStatus.TIMEOUT if timed_out else TransferStatus.FAILED,
                        str(exc))
                return
            try:
                conn.execute(slices, deadline)
            except _Broken as exc:
                slices, attempts_left = exc.left, attempts_left - 1
                if attempts_left <= 0 or deadline.expired():
                    status = TransferStatus.TIMEOUT if deadline.expired() else TransferStatus.FAILED
                    _finish(slices, status, f"connection to {peer[0]}:{peer[1]} failed: {exc}")
                    return
                self.drop_peer(peer)
                metrics.TRANSFER_RETRIES.labels(self.name).inc()
                continue
            self._release(conn)
            return

    def read_scatter(self, jobs: list["PeerJob"], deadline: Deadline) -> None:
        """Run READ-only jobs (one per peer) with no per-slice bookkeeping: READV frames
        (plain READs for one entry), ``READV_WINDOW`` in flight, each answer landing in the
        entries' views with one scatter receive; the first job on this thread, the others
        on lanes, so a stalled or unreachable peer cannot run the deadline out for the rest.

        Every entry ends COMPLETED, FAILED (refused by the peer: bounds, fence; or its
        connection broke ``ctx.retries`` more times) or TIMEOUT (the deadline passed). A
        broken connection is retried on a fresh one for the entries it did not finish, as
        :meth:`_lane` does.
        """
        self._attempts(jobs, deadline, True)

    def read_one(self, peer: tuple[str, int], view: memoryview, remote: int, gen: int,
                 deadline: Deadline) -> TransferStatus:
        """One READ of ``len(view)`` bytes at ``remote`` into ``view``, as :meth:`read_scatter`
        runs a one-entry job (a broken connection retried on a fresh one, ``ctx.retries``
        times), without the job's bookkeeping: COMPLETED, FAILED or TIMEOUT."""
        return self._one(peer, view, remote, gen, deadline, True)

    def write_one(self, peer: tuple[str, int], view: memoryview, remote: int, gen: int,
                  deadline: Deadline) -> TransferStatus:
        """One WRITE of ``view`` to ``remote``, as :meth:`write_gather` runs a one-entry job
        (a WRITE whose answer did not arrive is written again on a fresh connection: the same
        bytes to the same place), without the job's bookkeeping."""
        return self._one(peer, view, remote, gen, deadline, False)

    def _one(self, peer: tuple[str, int], view: memoryview, remote: int, gen: int,
             deadline: Deadline, reading: bool) -> TransferStatus:
        op = protocol.OP_READ if reading else protocol.OP_WRITE
        for _ in range(self.ctx.retries + 1):
            try:
                conn = self._acquire(peer, deadline)
            except KVPlaneError as exc:
                timed_out = isinstance(exc, Timeout) or deadline.expired()
                return TransferStatus.TIMEOUT if timed_out else TransferStatus.FAILED
            try:
                conn.set_timeout(deadline)
                rid = conn.next_id()
                head = protocol.pack_req(op, rid, remote, len(view), gen)
                if reading:
                    conn.sock.sendall(head)
                else:
                    protocol.send_all(conn.sock, [head, view])
                codes, _ = conn.receive_one(rid, view if reading else None)
            except TimeoutError:
                conn.close()
                return TransferStatus.TIMEOUT
            except (OSError, Unavailable, ProtocolError):
                conn.close()
                self.drop_peer(peer)
                if deadline.expired():
                    return TransferStatus.TIMEOUT
                metrics.TRANSFER_RETRIES.labels(self.name).inc()
                continue
            self._release(conn)
            return TransferStatus.FAILED if codes[0] else TransferStatus.COMPLETED
        return TransferStatus.FAILED

    def write_gather(self, jobs: list["PeerJob"], deadline: Deadline) -> None:
        """Run WRITE-only jobs (one per peer; ``views`` are the sources) as
        :meth:`read_scatter` runs reads: WRITEV frames (header, entry table and payloads in
        one ``sendmsg``; the peer receives the payloads with one scatter receive), plain
        WRITEs for one entry. A WRITE whose answer did not arrive is written again on the
        fresh connection: the same bytes to the same place."""
        self._attempts(jobs, deadline, False)

    def _attempts(self, jobs: list["PeerJob"], deadline: Deadline, reading: bool) -> None:
        for job in jobs:
            job.status, job.errors = [None] * len(job.remote), [""] * len(job.remote)
        todo = list(jobs)
        attempts_left = self.ctx.retries + 1
        while todo:
            broken = self._round(todo, deadline, reading)
            attempts_left -= 1
            if not broken:
                return
            for job, _ in broken:
                self.drop_peer(job.peer)
            if attempts_left <= 0 or deadline.expired():
                status = TransferStatus.TIMEOUT if deadline.expired() else TransferStatus.FAILED
                for job, exc in broken:
                    job.finish_pending(status, f"connection to {job.peer[0]}:{job.peer[1]} "
                                               f"failed: {exc}")
                return
            metrics.TRANSFER_RETRIES.labels(self.name).inc(len(broken))
            todo = [job for job, _ in broken]

    def _round(self, jobs: list["PeerJob"], deadline: Deadline, reading: bool
               ) -> list[tuple["PeerJob", BaseException]]:
        """One attempt at each job's unfinished entries, the peers in parallel (lanes);
        returns the jobs whose connection broke (their unfinished entries stay unfinished)."""
        futs = [self._lanes.submit(self._job, job, deadline, reading) for job in jobs[1:]]
        broken: list[tuple[PeerJob, BaseException]] = []
        got = self._job(jobs[0], deadline, reading) if jobs else None
        if got is not None:
            broken.append(got)
        for f, job in zip(futs, jobs[1:]):
            try:
                got = f.result()  # each ends by the deadline (kernel timeouts)
            except cf.CancelledError:  # the transport was closed meanwhile
                got = (job, Unavailable("transport closed"))
            if got is not None:
                broken.append(got)
        return broken

    def _job(self, job: "PeerJob", deadline: Deadline, reading: bool
             ) -> tuple["PeerJob", BaseException] | None:
        """One job's unfinished entries over one connection; (job, cause) if it broke."""
        ids = job.pending()
        if not ids:
            return None
        try:
            conn = self._acquire(job.peer, deadline)
        except KVPlaneError as exc:
            timed_out = isinstance(exc, Timeout) or deadline.expired()
            job.finish_pending(TransferStatus.TIMEOUT if timed_out else TransferStatus.FAILED,
                               str(exc))
            return None
        frames = [ids[a:b] for a, b in _frames([job.lengths[i] for i in ids])]
        frames.reverse()  # popped from the end, in order
        waiting: collections.deque[tuple[int, list[int]]] = collections.deque()
        try:
            conn.set_timeout(deadline)
            while frames or waiting:
                while frames and len(waiting) < READV_WINDOW:
                    ids = frames.pop()
                    waiting.append((_send_frame(conn, job, ids, reading), ids))
                if deadline.expired():
                    raise TimeoutError("deadline passed")
                conn.set_timeout(deadline)
                rid, ids = waiting[0]
                if len(ids) == 1:
                    codes, refused = conn.receive_one(rid, job.views[ids[0]] if reading else None)
                elif reading:
                    views = job.views
                    codes, refused = conn.receive_readv(
                        rid, views.each(ids) if isinstance(views, Span) else [views[i] for i in ids],
                        [job.lengths[i] for i in ids], _runs(views, ids))
                else:
                    codes, refused = conn.receive_codes(rid, len(ids))
                waiting.popleft()
                if not refused and not any(codes):
                    for i in ids:
                        job.status[i] = TransferStatus.COMPLETED
                    continue
                for i, code in zip(ids, codes):
                    if refused or code:
                        job.status[i] = TransferStatus.FAILED
                        job.errors[i] = refused or _refused(code, "READ" if reading else "WRITE")
                    else:
                        job.status[i] = TransferStatus.COMPLETED
        except TimeoutError:
            conn.close()
            job.finish_pending(TransferStatus.TIMEOUT, "deadline passed waiting for the peer")
        except (OSError, Unavailable, ProtocolError) as exc:
            conn.close()
            return job, exc
        else:
            self._release(conn)
        return None

    def describe(self, host: str, port: int, timeout: float) -> bytes:
        """Fetch a peer's segment descriptor (the P2P handshake)."""
        deadline = Deadline.after(timeout)
        conn = self._acquire((host, port), deadline)
        try:
            body = conn.call(protocol.OP_DESCRIBE, 0, b"", max(deadline.remaining(), 1e-3))
        except TimeoutError as exc:
            conn.close()
            raise Unavailable(f"handshake with {host}:{port} timed out") from exc
        except (OSError, ProtocolError) as exc:
            conn.close()
            raise Unavailable(f"handshake with {host}:{port} failed: {exc}") from exc
        self._release(conn)
        return body

    def retire(self, host: str, port: int, gens: list[int], timeout: float) -> None:
        """Have the listener at ``host:port`` refuse frames of ``gens`` (``OP_RETIRE``).

        Raises:
            Unavailable: the peer could not be reached or did not answer within ``timeout``.
        """
        deadline = Deadline.after(timeout)
        for k in range(0, len(gens), protocol.MAX_RETIRE):
            part = gens[k:k + protocol.MAX_RETIRE]
            conn = self._acquire((host, port), deadline)
            try:
                conn.call(protocol.OP_RETIRE, len(part), b"".join(
                    protocol.RETIRE_ENTRY.pack(g) for g in part), max(deadline.remaining(), 1e-3))
            except (OSError, ProtocolError) as exc:
                conn.close()
                raise Unavailable(f"retire at {host}:{port} failed: {exc}") from exc
            except KVPlaneError as exc:  # refused: the connection itself is fine
                self._release(conn)
                raise Unavailable(f"retire at {host}:{port} refused: {exc}") from exc
            self._release(conn)

    def grant(self, host: str, port: int, blob: bytes, timeout: float) -> bytes:
        """Install the grants packed in ``blob`` at the listener at ``host:port``
        (``OP_GRANT``); returns one status byte per grant (0: kept).

        Raises:
            Unavailable: the peer could not be reached, refused, or did not answer in time.
        """
        from kvplane.transfer.grants import GRANT_SIZE, MAX_GRANTS

        deadline = Deadline.after(timeout)
        out = b""
        step = MAX_GRANTS * GRANT_SIZE
        for k in range(0, len(blob), step):
            part = blob[k:k + step]
            conn = self._acquire((host, port), deadline)
            try:
                out += conn.call(protocol.OP_GRANT, len(part) // GRANT_SIZE, part,
                                 max(deadline.remaining(), 1e-3))
            except (OSError, ProtocolError) as exc:
                conn.close()
                raise Unavailable(f"grant at {host}:{port} failed: {exc}") from exc
            except KVPlaneError as exc:
                self._release(conn)
                raise Unavailable(f"grant at {host}:{port} refused: {exc}") from exc
            self._release(conn)
        return out

    def close(self) -> None:
        self._closed = True
        with self._lock:
            pools, self._idle = list(self._idle.values()), {}
        for conns in pools:
            for c in conns:
                c.close()
        self._lanes.shutdown(wait=False, cancel_futures=True)


def _refused(code: int, op: str = "READ") -> str:
    return f"{op} refused by the peer: {type(from_code(code, '')).__name__} ({code})"


def _frames(lengths: list[int]) -> list[tuple[int, int]]:
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


class PeerJob:
    """Many READs from one peer (:meth:`TcpTransport.read_scatter`) or WRITEs to it
    (:meth:`TcpTransport.write_gather`).

    ``remote``/``lengths``/``gens`` describe the entries, ``views`` are where READs land or
    where WRITEs come from (a list, or a :class:`Span` when they share one buffer);
    ``status`` and ``errors`` hold each entry's outcome once run (None: not finished; reset
    when the job starts, so entries may be appended until then).
    """

    __slots__ = ("peer", "remote", "lengths", "gens", "views", "status", "errors")

    def __init__(self, peer: tuple[str, int], remote: list[int], lengths: list[int],
                 gens: list[int], views: "list[memoryview] | Span") -> None:
        self.peer, self.remote, self.lengths, self.gens, self.views = peer, remote, lengths, gens, views
        self.status: list[TransferStatus | None] = [None] * len(remote)
        self.errors: list[str] = [""] * len(remote)

    def table(self, ids: list[int]) -> bytes:
        """The READV rows of entries ``ids``."""
        a, b = ids[0], ids[-1] + 1
        if b - a == len(ids):  # a run of consecutive entries (every first attempt): sliced
            rows = [0] * (3 * len(ids))
            rows[0::3], rows[1::3], rows[2::3] = self.remote[a:b], self.lengths[a:b], self.gens[a:b]
        else:
            rows = [x for i in ids for x in (self.remote[i], self.lengths[i], self.gens[i])]
        return struct.pack(f"<{len(rows)}Q", *rows)

    def pending(self) -> list[int]:
        return [i for i, st in enumerate(self.status) if st is None]

    def finish_pending(self, status: TransferStatus, error: str) -> None:
        for i in self.pending():
            self.status[i], self.errors[i] = status, error


def _send_frame(conn: Conn, job: PeerJob, ids: list[int], reading: bool) -> int:
    """Send one frame for entries ``ids``: a plain READ or WRITE (the listener's cheapest
    frame) for one entry, else a READV or WRITEV. Returns its request id."""
    if len(ids) == 1:
        i, rid = ids[0], conn.next_id()
        head = protocol.pack_req(protocol.OP_READ if reading else protocol.OP_WRITE, rid,
                                 job.remote[i], job.lengths[i], job.gens[i])
        protocol.send_all(conn.sock, [head] if reading else [head, job.views[i]])
        return rid
    table = job.table(ids)
    if reading:
        return conn.send_readv(table, len(ids))
    rid = conn.next_id()
    protocol.send_all(conn.sock, [
        protocol.pack_req(protocol.OP_WRITEV, rid, len(ids),
                          len(table) + sum(job.lengths[i] for i in ids)),
        table, *_runs(job.views, ids)])
    return rid


class Span:
    """The local buffers of entries that all lie in one memory view: entry ``i`` is
    ``base[offs[i]:offs[i] + lens[i]]``, sliced only when asked for (a batch of small entries
    then costs no view per entry)."""

    __slots__ = ("base", "offs", "lens")

    def __init__(self, base: memoryview, offs: list[int], lens: list[int]) -> None:
        self.base, self.offs, self.lens = base, offs, lens

    def __getitem__(self, i: int) -> memoryview:
        o = self.offs[i]
        return self.base[o:o + self.lens[i]]

    def __len__(self) -> int:
        return len(self.offs)

    def each(self, ids: list[int]) -> Iterator[memoryview]:
        """The views of entries ``ids``, one by one."""
        return map(self.__getitem__, ids)

    def runs(self, ids: list[int]) -> list[memoryview]:
        """The bytes of entries ``ids`` in order: one view when they follow each other in
        the buffer, else one per entry."""
        a, b = ids[0], ids[-1] + 1
        offs, lens = self.offs, self.lens
        if b - a == len(ids) and offs[a + 1:b] == list(map(operator.add, offs[a:b - 1],
                                                            lens[a:b - 1])):
            return [self.base[offs[a]:offs[b - 1] + lens[b - 1]]]
        return [self[i] for i in ids]


def _runs(views: "list[memoryview] | Span", ids: list[int]) -> list[memoryview]:
    return views.runs(ids) if isinstance(views, Span) else [views[i] for i in ids]


def _readv_groups(slices: list[Slice]) -> list[list[Slice]]:
    """Consecutive slices cut into READV frames of at most MAX_READV entries and READV_BYTES."""
    return [slices[a:b] for a, b in _frames([s.length for s in slices])]


def _finish(slices: list[Slice], status: TransferStatus, error: str) -> None:
    for s in slices:
        s.done(status, error)
