"""The TCP mesh between the ranks of one process group, and its progress engine.

Owns the data-plane sockets (127.0.0.1, one connection per pair of ranks) and moves framed
messages with ``sendmsg``/``recv_into`` straight from and into caller memory (numpy views of
tensors): no copies on the expected path. Only the communication thread of the owning process
group may call into a :class:`Mesh`; it is not thread-safe.

Failure model: EOF, a reset, a peer reported stale by the heartbeat, or the deadline turn into
:class:`AttemptFailed`, never a hang. A frame whose header carries a different participant mask
for the running op is *evidence* that some peer excluded someone; :meth:`Mesh.exchange` turns it
into :class:`AttemptFailed` as well so every survivor converges on the same, smaller mask.

Must not import torch: it works on memoryviews only.
"""

from __future__ import annotations

import enum
import logging
import selectors
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvplane.collectives.frames import (
    HEADER_SIZE,
    KIND_ABORT,
    KIND_DATA,
    KIND_HELLO,
    KIND_P2P,
    Header,
    bits,
)
from kvplane.common.errors import ProtocolError, Timeout, Unavailable

log = logging.getLogger(__name__)

_SOCK_BUF = 1 << 20  # per-direction socket buffer (the kernel doubles it)
_POLL = 0.05  # seconds between liveness checks while blocked
_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE


class AttemptFailed(Exception):
    """The running attempt cannot finish: ``exclude`` are the ranks to drop (a bitmask)."""

    def __init__(self, exclude: int, reason: str, evidence: bool = False) -> None:
        super().__init__(reason)
        self.exclude = exclude
        self.reason = reason
        self.evidence = evidence


@dataclass(slots=True)
class Post:
    """A receive posted on one connection: the next frame matching it lands in ``buf``."""

    kind: int
    seq: int
    mask: int
    step: int
    tag: int
    buf: memoryview
    done: bool = False


@dataclass(slots=True)
class StreamSend:
    """One frame of a pipelined stream to the right-hand peer.

    Attributes:
        step: step id written in the header (unique, increasing within the attempt).
        view: payload bytes (read when the frame is queued).
        after_recv: index of the receive that must complete (and run its callback) first, or -1.
    """

    step: int
    view: memoryview
    after_recv: int = -1


@dataclass(slots=True)
class StreamRecv:
    """One frame of a pipelined stream from the left-hand peer.

    Attributes:
        step: expected step id.
        view: where the payload lands.
        done: called on the comm thread once the payload is in ``view``.
        after_send: index of the send that must be fully written before this receive is
            posted (its buffer is reused), or -1.
    """

    step: int
    view: memoryview
    done: Callable[[], None] | None = None
    after_send: int = -1


class Sink(enum.Enum):
    """Where the payload of the frame being read on a connection goes."""

    NONE = "none"  # no frame under way: the next bytes are a header
    HOLD = "hold"  # not routable yet (a newer epoch, a later op or attempt): stop reading
    POST = "post"  # into the buffer of the receive posted on this connection
    DISCARD = "discard"  # stale (older epoch, op or attempt): read and thrown away
    STASH = "stash"  # point-to-point data nobody asked for yet: kept for a later receive


@dataclass(slots=True)
class _Out:
    bufs: list[memoryview]
    left: int
    kind: int
    started: bool = False


@dataclass(slots=True)
class _Conn:
    rank: int
    sock: socket.socket
    alive: bool = True
    hdr: bytearray = field(default_factory=lambda: bytearray(HEADER_SIZE))
    hgot: int = 0
    cur: Header | None = None
    sink: Sink = Sink.NONE
    dst: memoryview | None = None
    got: int = 0
    post: Post | None = None
    outq: deque[_Out] = field(default_factory=deque)
    events: int = 0
    last_rx: float = field(default_factory=time.monotonic)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_BUF)


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise Timeout("handshake timed out")
        sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise Unavailable("peer closed during handshake")
        buf += chunk
    return bytes(buf)


class Mesh:
    """Connections of one rank to its peers plus the progress engine.

    Args:
        rank: this process's rank (slot).
        max_payload: largest frame payload accepted from a peer.
        stash_limit: most bytes of unexpected P2P payloads buffered before a peer is dropped.
    """

    def __init__(self, rank: int, max_payload: int, stash_limit: int) -> None:
        self.rank = rank
        self.epoch = 0
        self.max_payload = max_payload
        self.stash_limit = stash_limit
        self.conns: dict[int, _Conn] = {}
        self.evidence: dict[int, int] = {}
        self.stash: dict[tuple[int, int, int], deque[bytearray]] = {}
        self._stashed = 0
        self.cur_seq = -1
        self.cur_mask = 0
        self._sel = selectors.DefaultSelector()
        self._scratch = bytearray(1 << 20)
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port: int = self.listener.getsockname()[1]

    # ------------------------------------------------------------------ connections
    def connect(self, peer: int, port: int, incarnation: int, deadline: float) -> None:
        """Open the connection to ``peer`` listening on ``port`` and say HELLO (blocking).

        Raises:
            Unavailable: the peer refused or closed the connection.
            Timeout: the deadline passed.
        """
        left = deadline - time.monotonic()
        if left <= 0:
            raise Timeout(f"connect to rank {peer} timed out")
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=left)
            _tune(sock)
            sock.sendall(Header(KIND_HELLO, self.rank, self.epoch, 0, 0, 0, incarnation, 0).pack())
        except TimeoutError as exc:
            raise Timeout(f"connect to rank {peer} timed out") from exc
        except OSError as exc:
            raise Unavailable(f"connect to rank {peer} failed: {exc}") from exc
        self.attach(peer, sock)

    def accept(self, expected: set[int], deadline: float) -> None:
        """Accept HELLO connections until every rank in ``expected`` is connected (blocking).

        Raises:
            Timeout: some expected rank did not connect before the deadline.
        """
        pending = set(expected)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout(f"ranks {sorted(pending)} did not connect")
            self.listener.settimeout(left)
            try:
                sock, _ = self.listener.accept()
            except TimeoutError as exc:
                raise Timeout(f"ranks {sorted(pending)} did not connect") from exc
            try:
                hdr = Header.unpack(_recv_exact(sock, HEADER_SIZE, deadline), 0)
            except (OSError, ProtocolError, Unavailable, Timeout) as exc:
                log.warning("dropping bad handshake: %s", exc)
                sock.close()
                continue
            if hdr.kind != KIND_HELLO or hdr.src not in pending:
                log.warning("unexpected hello from rank %s", hdr.src)
                sock.close()
                continue
            _tune(sock)
            self.attach(hdr.src, sock)
            pending.discard(hdr.src)

    def attach(self, peer: int, sock: socket.socket) -> None:
        """Use ``sock``, already connected (and past HELLO), as the connection to ``peer``.

        Replaces any previous connection to ``peer``. Tests wire scripted peers in this way.
        """
        self.drop(peer)
        sock.setblocking(False)
        self.conns[peer] = _Conn(peer, sock)

    def drop(self, peer: int) -> None:
        """Close and forget the connection to ``peer`` (idempotent)."""
        conn = self.conns.pop(peer, None)
        if conn is not None:
            self._lost(conn)

    def last_rx(self, peer: int) -> float:
        """Monotonic time payload bytes last arrived from ``peer`` (0 if unknown)."""
        conn = self.conns.get(peer)
        return 0.0 if conn is None else conn.last_rx

    def alive(self, peer: int) -> bool:
        """True while the connection to ``peer`` is open."""
        conn = self.conns.get(peer)
        return conn is not None and conn.alive

    def set_epoch(self, epoch: int) -> None:
        """Enter a new membership epoch: forget evidence and drop frames of older epochs."""
        self.epoch = epoch
        self.evidence.clear()
        self.cur_seq, self.cur_mask = -1, 0
        self._reroute()

    def close(self) -> None:
        """Close every socket (idempotent)."""
        for peer in list(self.conns):
            self.drop(peer)
        self.listener.close()
        self._sel.close()

    # ------------------------------------------------------------------ attempts
    def begin(self, seq: int, mask: int) -> None:
        """Start (or restart) attempt ``mask`` of collective ``seq``."""
        self.cur_seq, self.cur_mask = seq, mask
        self._reroute()

    def abandon(self, newmask: int) -> None:
        """Give up the running attempt: drop its posts and queued sends, tell ``newmask`` (ABORT)."""
        for conn in self.conns.values():
            if conn.post is not None and conn.post.kind == KIND_DATA:
                conn.post = None
                if conn.sink is Sink.POST:
                    conn.sink, conn.dst = Sink.DISCARD, None
            conn.outq = deque(o for o in conn.outq if o.started or o.kind != KIND_DATA)
            if conn.alive and newmask >> conn.rank & 1 and conn.rank != self.rank:
                frame = Header(KIND_ABORT, self.rank, self.epoch, self.cur_seq, newmask, 0, 0, 0)
                self._queue(conn, [memoryview(frame.pack())], KIND_ABORT)
        self.begin(self.cur_seq, newmask)

    def data_header(self, step: int, nbytes: int) -> Header:
        """The header of a payload of the running attempt."""
        return Header(KIND_DATA, self.rank, self.epoch, self.cur_seq, self.cur_mask, step, 0, nbytes)

    # ------------------------------------------------------------------ progress
    def exchange(self, sends: list[tuple[int, Header, memoryview]], posts: list[tuple[int, Post]],
                 deadline: float, stale: Callable[[int], bool]) -> None:
        """Send and receive one step's frames, driving every connection until they are done.

        Args:
            sends: ``(peer, header, payload)`` to send in order.
            posts: ``(peer, post)`` receives; at most one per peer.
            deadline: monotonic time after which blocked peers count as failed.
            stale: the heartbeat's verdict on a peer.

        Raises:
            AttemptFailed: a peer failed, missed the deadline, or evidence shrank the mask.
        """
        outs: list[tuple[int, _Out]] = []
        for peer, hdr, payload in sends:
            outs.append((peer, self._queue(self._conn(peer), [memoryview(hdr.pack()), payload], hdr.kind)))
        for peer, post in posts:
            self._conn(peer)
            if post.kind == KIND_P2P and self._take_stash(peer, post):
                continue
            self._post(peer, post)
        coll = any(h.kind == KIND_DATA for _, h, _ in sends) or any(q.kind == KIND_DATA for _, q in posts)
        pending_posts = list(posts)
        while True:
            if coll:
                self._check_evidence()
            outs = [(p, o) for p, o in outs if o.left]
            pending_posts = [(p, q) for p, q in pending_posts if not q.done]
            if not outs and not pending_posts:
                return
            self._wait({p for p, _ in outs} | {p for p, _ in pending_posts}, deadline, stale)

    def stream(self, right: int, sends: list[StreamSend], left: int, recvs: list[StreamRecv],
               deadline: float, stale: Callable[[int], bool]) -> None:
        """Pipelined exchange: frames go to ``right`` and come from ``left`` in list order, each
        send queued as soon as the receive it depends on completed.

        Raises:
            AttemptFailed: a peer failed, missed the deadline, or evidence shrank the mask.
        """
        outs: list[_Out] = []
        done_recvs = 0
        post: Post | None = None
        while True:
            self._check_evidence()
            progressed = True
            while progressed:
                progressed = False
                if post is not None and post.done:
                    cb = recvs[done_recvs].done
                    if cb is not None:
                        cb()
                    done_recvs, post, progressed = done_recvs + 1, None, True
                while len(outs) < len(sends) and sends[len(outs)].after_recv < done_recvs:
                    fr = sends[len(outs)]
                    outs.append(self._queue(self._conn(right), [memoryview(self.data_header(
                        fr.step, len(fr.view)).pack()), fr.view], KIND_DATA))
                if post is None and done_recvs < len(recvs):
                    rv = recvs[done_recvs]
                    if rv.after_send < 0 or (rv.after_send < len(outs) and not outs[rv.after_send].left):
                        post = self._post(left, Post(KIND_DATA, self.cur_seq, self.cur_mask, rv.step, 0,
                                                     rv.view))
                        progressed = progressed or post.done
            sending = len(outs) < len(sends) or any(o.left for o in outs)
            if done_recvs == len(recvs) and not sending:
                return
            blocked = ({right} if sending else set()) | ({left} if done_recvs < len(recvs) else set())
            self._wait(blocked, deadline, stale)

    def _check_evidence(self) -> None:
        ev = self.evidence.get(self.cur_seq)
        if ev is not None and ev & self.cur_mask != self.cur_mask:
            raise AttemptFailed(self.cur_mask & ~ev, "a peer reported a smaller view", True)

    def _conn(self, peer: int) -> _Conn:
        conn = self.conns.get(peer)
        if conn is None or not conn.alive:
            raise AttemptFailed(1 << peer, f"rank {peer} is not connected")
        return conn

    def _post(self, peer: int, post: Post) -> Post:
        """Post a receive on ``peer``'s connection; a frame already waiting is routed at once."""
        conn = self._conn(peer)
        conn.post = post
        if conn.sink is Sink.HOLD:
            try:
                self._route(conn)
            except ProtocolError as exc:
                log.info("connection to rank %s lost: %s", peer, exc)
                self._lost(conn)
        return post

    def _wait(self, blocked: set[int], deadline: float, stale: Callable[[int], bool]) -> None:
        """Fail the peers we wait on that are gone, silent or late; otherwise pump once."""
        failed = {p for p in blocked if not self.alive(p) or stale(p)}
        now = time.monotonic()
        if now >= deadline:
            failed = blocked
        if failed:
            raise AttemptFailed(bits(failed), f"ranks {sorted(failed)} failed or missed the deadline")
        self._pump(min(deadline - now, _POLL))

    def flush(self, deadline: float) -> None:
        """Drive queued control frames out until sent or ``deadline`` (never raises on peers)."""
        while any(conn.alive and conn.outq for conn in self.conns.values()):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._pump(min(left, _POLL))

    def _pump(self, timeout: float) -> None:
        for conn in list(self.conns.values()):
            if not conn.alive:
                continue
            want = (0 if conn.sink is Sink.HOLD else _READ) | (_WRITE if conn.outq else 0)
            if want != conn.events:
                if conn.events == 0:
                    self._sel.register(conn.sock, want, conn)
                elif want == 0:
                    self._sel.unregister(conn.sock)
                else:
                    self._sel.modify(conn.sock, want, conn)
                conn.events = want
        for key, ev in self._sel.select(max(0.0, timeout)):
            conn = key.data
            if ev & _READ and conn.alive:
                self._on_read(conn)
            if ev & _WRITE and conn.alive:
                self._on_write(conn)

    def _queue(self, conn: _Conn, bufs: list[memoryview], kind: int) -> _Out:
        bufs = [b.cast("B") if b.format != "B" or b.ndim != 1 else b for b in bufs]
        o = _Out(bufs, sum(len(b) for b in bufs), kind)
        conn.outq.append(o)
        return o

    def _on_write(self, conn: _Conn) -> None:
        while conn.outq:
            o = conn.outq[0]
            try:
                n = conn.sock.sendmsg(o.bufs)
            except BlockingIOError:
                return
            except OSError as exc:
                log.info("send to rank %s failed: %s", conn.rank, exc)
                self._lost(conn)
                return
            o.started = True
            o.left -= n
            while n and o.bufs:
                if n >= len(o.bufs[0]):
                    n -= len(o.bufs.pop(0))
                else:
                    o.bufs[0] = o.bufs[0][n:]
                    n = 0
            if o.left:
                return
            conn.outq.popleft()

    def _on_read(self, conn: _Conn) -> None:
        """Read what ``conn`` has (headers, then payloads into their sinks) until it would block
        or a frame has to be held; a broken or hostile connection is dropped."""
        try:
            while conn.alive and conn.sink is not Sink.HOLD:
                if conn.sink is Sink.NONE:
                    self._read_header(conn)
                else:
                    self._read_payload(conn)
        except BlockingIOError:
            return
        except (OSError, Unavailable, ProtocolError) as exc:
            log.info("connection to rank %s lost: %s", conn.rank, exc)
            self._lost(conn)

    def _read_header(self, conn: _Conn) -> None:
        """Read header bytes; once the header is whole, route its frame."""
        n = conn.sock.recv_into(memoryview(conn.hdr)[conn.hgot:])
        if n == 0:
            raise Unavailable("eof")
        conn.hgot += n
        if conn.hgot < HEADER_SIZE:
            return
        conn.hgot, conn.got = 0, 0
        conn.cur = Header.unpack(conn.hdr, self.max_payload)
        self._route(conn)

    def _read_payload(self, conn: _Conn) -> None:
        """Read payload bytes into the frame's sink; complete the frame once it is whole."""
        header = conn.cur
        assert header is not None
        want = header.nbytes - conn.got
        if want:
            if conn.sink is Sink.DISCARD:
                view = memoryview(self._scratch)[:min(want, len(self._scratch))]
            else:
                assert conn.dst is not None
                view = conn.dst[conn.got:]
            n = conn.sock.recv_into(view)
            if n == 0:
                raise Unavailable("eof")
            conn.got += n
            conn.last_rx = time.monotonic()
        if conn.got == header.nbytes:
            self._complete(conn)

    def _route(self, conn: _Conn) -> None:
        """Choose the sink of the frame whose header was just read on ``conn``.

        Raises:
            ProtocolError: a frame that cannot be right (the connection is dropped).
        """
        header = conn.cur
        assert header is not None
        if header.epoch != self.epoch:
            conn.sink = Sink.DISCARD if header.epoch < self.epoch else Sink.HOLD
        elif header.kind == KIND_ABORT:
            self.note(header.seq, header.mask)
            conn.sink = Sink.DISCARD
        elif header.kind == KIND_DATA:
            conn.sink = self._route_data(conn, header)
        elif header.kind == KIND_P2P:
            conn.sink = self._route_p2p(conn, header)
        else:
            raise ProtocolError(f"unexpected frame kind {header.kind}")
        if conn.sink is not Sink.HOLD and header.nbytes == 0:
            self._complete(conn)

    def _route_data(self, conn: _Conn, header: Header) -> Sink:
        """A collective's payload: the posted step, a stale attempt, or one to hold for later."""
        post = conn.post
        if post is not None and post.kind == KIND_DATA and \
                (header.seq, header.mask, header.step) == (post.seq, post.mask, post.step):
            return self._into_post(conn, header, post)
        if self._stale_data(header):
            return Sink.DISCARD
        if header.seq == self.cur_seq and header.mask != self.cur_mask:
            self.note(header.seq, header.mask)  # the sender runs this op over fewer ranks
        return Sink.HOLD

    def _stale_data(self, header: Header) -> bool:
        """True for an op this rank has finished, or an earlier attempt of the running op (an
        attempt's mask only ever shrinks, so a mask that contains ours is an older one)."""
        if header.seq != self.cur_seq:
            return header.seq < self.cur_seq
        return header.mask != self.cur_mask and header.mask & self.cur_mask == self.cur_mask

    def _route_p2p(self, conn: _Conn, header: Header) -> Sink:
        """Point-to-point data: the posted receive, else the stash (bounded)."""
        post = conn.post
        if post is not None and post.kind == KIND_P2P and (header.seq, header.tag) == (post.seq, post.tag):
            return self._into_post(conn, header, post)
        if self._stashed + header.nbytes > self.stash_limit:
            raise ProtocolError("unexpected point-to-point data over the stash limit")
        self._stashed += header.nbytes
        conn.dst = memoryview(bytearray(header.nbytes))
        return Sink.STASH

    def _into_post(self, conn: _Conn, header: Header, post: Post) -> Sink:
        if header.nbytes != len(post.buf):
            raise ProtocolError(f"rank {conn.rank} sent {header.nbytes} bytes, expected {len(post.buf)}")
        conn.dst = post.buf
        return Sink.POST

    def _complete(self, conn: _Conn) -> None:
        """The frame on ``conn`` is whole: finish its post or keep its stash; await a header."""
        header = conn.cur
        assert header is not None
        if conn.sink is Sink.POST and conn.post is not None:
            conn.post.done = True
            conn.post = None
        elif conn.sink is Sink.STASH and conn.dst is not None:
            key = (header.src, header.tag, header.seq)
            self.stash.setdefault(key, deque()).append(conn.dst.obj)  # type: ignore[arg-type]  # a stash sink holds a buffer
        conn.cur, conn.sink, conn.dst, conn.got = None, Sink.NONE, None, 0

    def _take_stash(self, peer: int, post: Post) -> bool:
        q = self.stash.get((peer, post.tag, post.seq))
        if not q:
            return False
        data = q.popleft()
        if not q:
            del self.stash[(peer, post.tag, post.seq)]
        self._stashed -= len(data)
        if len(data) != len(post.buf):
            raise ProtocolError(f"rank {peer} sent {len(data)} bytes, expected {len(post.buf)}")
        post.buf[:] = data
        post.done = True
        return True

    def note(self, seq: int, mask: int) -> None:
        """Record a peer's participant mask for ``seq`` (intersected with what we knew)."""
        self.evidence[seq] = self.evidence.get(seq, mask) & mask

    def _reroute(self) -> None:
        for conn in self.conns.values():
            if conn.alive and conn.sink is Sink.HOLD:
                try:
                    self._route(conn)
                except ProtocolError as exc:
                    log.info("connection to rank %s lost: %s", conn.rank, exc)
                    self._lost(conn)

    def _lost(self, conn: _Conn) -> None:
        if conn.events:
            try:
                self._sel.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
            conn.events = 0
        conn.alive = False
        conn.outq.clear()
        conn.sock.close()
