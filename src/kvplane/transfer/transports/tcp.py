"""TCP transport: pooled, striped, pipelined frames to any peer's data listener.

Owns :class:`TcpTransport`: the connection pool per peer, the striping of a batch over up to
``streams`` connections (the first on the calling thread), the retry of a broken connection's
slices on a fresh one, the one-item fast path and the control channel (DESCRIBE, RETIRE,
GRANT). The connection itself is ``tcp_conn``; the vectored runs are ``tcp_vectored``. A
passed deadline turns what is left into TIMEOUT. Never imports the engine.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading

from kvplane.common import metrics
from kvplane.common.deadline import Deadline
from kvplane.common.errors import KVPlaneError, ProtocolError, Timeout, Unavailable
from kvplane.transfer import protocol
from kvplane.transfer.batch import Slice
from kvplane.transfer.grants import GRANT_SIZE, MAX_GRANTS
from kvplane.transfer.jobs import Peer, PeerJob
from kvplane.transfer.seam import Capabilities, Route, Transport, TransportContext
from kvplane.transfer.transports.tcp_conn import Broken, Conn, finish
from kvplane.transfer.transports.tcp_vectored import run_jobs
from kvplane.transfer.types import TransferStatus

STRIPE_MIN = 512 << 10  # batches smaller than this stay on one connection
STRIPE_SLICE_MIN = 64 << 10  # and so do batches of smaller slices (READV moves them in one frame;
# helper lanes would only contend for the GIL)
MAX_IDLE = 16  # pooled idle connections per peer


class TcpTransport(Transport):
    """Pipelined, pooled, striped TCP to any peer's data listener."""

    name = "tcp"
    capabilities = Capabilities(priority=1, sliced=True, via_listener=True)

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self._idle: dict[tuple[str, int], list[Conn]] = {}
        self._lock = threading.Lock()
        self._lanes = cf.ThreadPoolExecutor(max(1, ctx.streams * 4), thread_name_prefix="te-tcp-lane")
        self._closed = False

    def can_reach(self, route: Route) -> bool:
        return route.segment.port > 0

    # -- pool ------------------------------------------------------------------------------
    def acquire(self, peer: tuple[str, int], deadline: Deadline) -> Conn:
        """An idle pooled connection to ``peer``, or a new one (KVPlaneError: none)."""
        with self._lock:
            idle = self._idle.get(peer)
            if idle:
                return idle.pop()
        return self._connect(peer, min(self.ctx.connect_timeout, max(deadline.remaining(), 1e-3)))

    def _connect(self, peer: tuple[str, int], timeout: float) -> Conn:
        """A new connection to ``peer`` (tests override this to hand out fake sockets)."""
        return Conn.open(peer[0], peer[1], self.ctx.token, timeout)

    def release(self, conn: Conn) -> None:
        """Give ``conn`` back to the pool (closed if it died, the pool is full or closed)."""
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
                conn = self.acquire(peer, deadline)
            except KVPlaneError as exc:
                timed_out = isinstance(exc, Timeout) or deadline.expired()
                finish(slices, TransferStatus.TIMEOUT if timed_out else TransferStatus.FAILED,
                        str(exc))
                return
            try:
                conn.execute(slices, deadline)
            except Broken as exc:
                slices, attempts_left = exc.left, attempts_left - 1
                if attempts_left <= 0 or deadline.expired():
                    status = TransferStatus.TIMEOUT if deadline.expired() else TransferStatus.FAILED
                    finish(slices, status, f"connection to {peer[0]}:{peer[1]} failed: {exc}")
                    return
                self.drop_peer(peer)
                metrics.TRANSFER_RETRIES.labels(self.name).inc()
                continue
            self.release(conn)
            return

    def read_scatter(self, jobs: list[PeerJob], deadline: Deadline) -> None:
        """Run READ-only jobs (one per peer) with no per-slice bookkeeping: READV frames
        (plain READs for one entry), ``READV_WINDOW`` in flight, each answer landing in the
        entries' views with one scatter receive; the first job on this thread, the others
        on lanes, so a stalled or unreachable peer cannot run the deadline out for the rest.

        Every entry ends COMPLETED, FAILED (refused by the peer: bounds, fence; or its
        connection broke ``ctx.retries`` more times) or TIMEOUT (the deadline passed). A
        broken connection is retried on a fresh one for the entries it did not finish, as
        :meth:`_lane` does.
        """
        run_jobs(self, self._lanes, jobs, deadline, True, self.ctx.retries, self.name)

    def read_one(self, peer: Peer, view: memoryview, remote: int, gen: int,
                 deadline: Deadline) -> TransferStatus:
        """One READ of ``len(view)`` bytes at ``remote`` into ``view``, as :meth:`read_scatter`
        runs a one-entry job (a broken connection retried on a fresh one, ``ctx.retries``
        times), without the job's bookkeeping: COMPLETED, FAILED or TIMEOUT."""
        return self._one(peer, view, remote, gen, deadline, True)

    def write_one(self, peer: Peer, view: memoryview, remote: int, gen: int,
                  deadline: Deadline) -> TransferStatus:
        """One WRITE of ``view`` to ``remote``, as :meth:`write_gather` runs a one-entry job
        (a WRITE whose answer did not arrive is written again on a fresh connection: the same
        bytes to the same place), without the job's bookkeeping."""
        return self._one(peer, view, remote, gen, deadline, False)

    def _one(self, peer: Peer, view: memoryview, remote: int, gen: int,
             deadline: Deadline, reading: bool) -> TransferStatus:
        op = protocol.OP_READ if reading else protocol.OP_WRITE
        for _ in range(self.ctx.retries + 1):
            try:
                conn = self.acquire(peer, deadline)
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
            self.release(conn)
            return TransferStatus.FAILED if codes[0] else TransferStatus.COMPLETED
        return TransferStatus.FAILED

    def write_gather(self, jobs: list[PeerJob], deadline: Deadline) -> None:
        """Run WRITE-only jobs (one per peer; ``views`` are the sources) as
        :meth:`read_scatter` runs reads: WRITEV frames (header, entry table and payloads in
        one ``sendmsg``; the peer receives the payloads with one scatter receive), plain
        WRITEs for one entry. A WRITE whose answer did not arrive is written again on the
        fresh connection: the same bytes to the same place."""
        run_jobs(self, self._lanes, jobs, deadline, False, self.ctx.retries, self.name)

    # -- control channel -------------------------------------------------------------------
    def describe(self, peer: Peer, timeout: float) -> bytes:
        """Fetch a peer's segment descriptor (the P2P handshake)."""
        deadline = Deadline.after(timeout)
        conn = self.acquire(peer, deadline)
        try:
            body = conn.call(protocol.OP_DESCRIBE, 0, b"", max(deadline.remaining(), 1e-3))
        except TimeoutError as exc:
            conn.close()
            raise Unavailable(f"handshake with {peer[0]}:{peer[1]} timed out") from exc
        except (OSError, ProtocolError) as exc:
            conn.close()
            raise Unavailable(f"handshake with {peer[0]}:{peer[1]} failed: {exc}") from exc
        self.release(conn)
        return body

    def retire(self, peer: Peer, gens: list[int], timeout: float) -> None:
        """Have the listener at ``peer`` refuse frames of ``gens`` (``OP_RETIRE``).

        Raises:
            Unavailable: the peer could not be reached or did not answer within ``timeout``.
        """
        step = protocol.MAX_RETIRE
        parts = [gens[k:k + step] for k in range(0, len(gens), step)]
        self._calls(peer, protocol.OP_RETIRE, "retire", timeout, [
            (len(p), b"".join(protocol.RETIRE_ENTRY.pack(g) for g in p)) for p in parts])

    def grant(self, peer: Peer, blob: bytes, timeout: float) -> bytes:
        """Install the grants packed in ``blob`` at the listener at ``peer`` (``OP_GRANT``);
        returns one status byte per grant (0: kept).

        Raises:
            Unavailable: the peer could not be reached, refused, or did not answer in time.
        """
        step = MAX_GRANTS * GRANT_SIZE
        parts = [blob[k:k + step] for k in range(0, len(blob), step)]
        return self._calls(peer, protocol.OP_GRANT, "grant", timeout,
                           [(len(p) // GRANT_SIZE, p) for p in parts])

    def _calls(self, peer: Peer, op: int, what: str, timeout: float,
               parts: list[tuple[int, bytes]]) -> bytes:
        """One control call per ``(count, payload)`` part, in order, within ``timeout``;
        returns the answers' bodies joined (Unavailable: unreachable or refused)."""
        deadline = Deadline.after(timeout)
        out = b""
        for count, payload in parts:
            conn = self.acquire(peer, deadline)
            try:
                out += conn.call(op, count, payload, max(deadline.remaining(), 1e-3))
            except (OSError, ProtocolError) as exc:
                conn.close()
                raise Unavailable(f"{what} at {peer[0]}:{peer[1]} failed: {exc}") from exc
            except KVPlaneError as exc:  # refused: the connection itself is fine
                self.release(conn)
                raise Unavailable(f"{what} at {peer[0]}:{peer[1]} refused: {exc}") from exc
            self.release(conn)
        return out

    def close(self) -> None:
        """Close the pooled connections and stop the lanes (idempotent)."""
        self._closed = True
        with self._lock:
            pools, self._idle = list(self._idle.values()), {}
        for conns in pools:
            for c in conns:
                c.close()
        self._lanes.shutdown(wait=False, cancel_futures=True)

