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

import logging
import selectors
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvplane.collectives.frames import (
    HEADER_SIZE, KIND_ABORT, KIND_DATA, KIND_HELLO, KIND_P2P, Header, bits,
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
    sink: str = ""  # "" no frame, "hold", "post", "discard", "stash"
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
        c = self.conns.pop(peer, None)
        if c is not None:
            self._lost(c)

    def last_rx(self, peer: int) -> float:
        """Monotonic time payload bytes last arrived from ``peer`` (0 if unknown)."""
        c = self.conns.get(peer)
        return 0.0 if c is None else c.last_rx

    def alive(self, peer: int) -> bool:
        """True while the connection to ``peer`` is open."""
        c = self.conns.get(peer)
        return c is not None and c.alive

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
        for c in self.conns.values():
            if c.post is not None and c.post.kind == KIND_DATA:
                c.post = None
                if c.sink == "post":
                    c.sink, c.dst = "discard", None
            c.outq = deque(o for o in c.outq if o.started or o.kind != KIND_DATA)
            if c.alive and newmask >> c.rank & 1 and c.rank != self.rank:
                frame = Header(KIND_ABORT, self.rank, self.epoch, self.cur_seq, newmask, 0, 0, 0)
                self._queue(c, [memoryview(frame.pack())], KIND_ABORT)
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
                    fr = recvs[done_recvs]
                    if fr.after_send < 0 or (fr.after_send < len(outs) and not outs[fr.after_send].left):
                        post = self._post(left, Post(KIND_DATA, self.cur_seq, self.cur_mask, fr.step, 0, fr.view))
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
        c = self.conns.get(peer)
        if c is None or not c.alive:
            raise AttemptFailed(1 << peer, f"rank {peer} is not connected")
        return c

    def _post(self, peer: int, post: Post) -> Post:
        """Post a receive on ``peer``'s connection; a frame already waiting is routed at once."""
        c = self._conn(peer)
        c.post = post
        if c.sink == "hold":
            try:
                self._route(c)
            except ProtocolError as exc:
                log.info("connection to rank %s lost: %s", peer, exc)
                self._lost(c)
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
        while any(c.alive and c.outq for c in self.conns.values()):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._pump(min(left, _POLL))

    def _pump(self, timeout: float) -> None:
        for c in list(self.conns.values()):
            if not c.alive:
                continue
            want = (0 if c.sink == "hold" else _READ) | (_WRITE if c.outq else 0)
            if want != c.events:
                if c.events == 0:
                    self._sel.register(c.sock, want, c)
                elif want == 0:
                    self._sel.unregister(c.sock)
                else:
                    self._sel.modify(c.sock, want, c)
                c.events = want
        for key, ev in self._sel.select(max(0.0, timeout)):
            c = key.data
            if ev & _READ and c.alive:
                self._on_read(c)
            if ev & _WRITE and c.alive:
                self._on_write(c)

    def _queue(self, c: _Conn, bufs: list[memoryview], kind: int) -> _Out:
        bufs = [b.cast("B") if b.format != "B" or b.ndim != 1 else b for b in bufs]
        o = _Out(bufs, sum(len(b) for b in bufs), kind)
        c.outq.append(o)
        return o

    def _on_write(self, c: _Conn) -> None:
        while c.outq:
            o = c.outq[0]
            try:
                n = c.sock.sendmsg(o.bufs)
            except BlockingIOError:
                return
            except OSError as exc:
                log.info("send to rank %s failed: %s", c.rank, exc)
                self._lost(c)
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
            c.outq.popleft()

    def _on_read(self, c: _Conn) -> None:
        try:
            while c.alive:
                if c.sink == "":
                    n = c.sock.recv_into(memoryview(c.hdr)[c.hgot:])
                    if n == 0:
                        raise Unavailable("eof")
                    c.hgot += n
                    if c.hgot < HEADER_SIZE:
                        continue
                    c.hgot, c.got = 0, 0
                    c.cur = Header.unpack(c.hdr, self.max_payload)
                    self._route(c)
                elif c.sink == "hold":
                    return
                else:
                    assert c.cur is not None
                    want = c.cur.nbytes - c.got
                    if want:
                        if c.sink == "discard":
                            view = memoryview(self._scratch)[:min(want, len(self._scratch))]
                        else:
                            assert c.dst is not None
                            view = c.dst[c.got:]
                        n = c.sock.recv_into(view)
                        if n == 0:
                            raise Unavailable("eof")
                        c.got += n
                        c.last_rx = time.monotonic()
                    if c.got == c.cur.nbytes:
                        self._complete(c)
        except BlockingIOError:
            return
        except (OSError, Unavailable, ProtocolError) as exc:
            log.info("connection to rank %s lost: %s", c.rank, exc)
            self._lost(c)

    def _route(self, c: _Conn) -> None:
        h = c.cur
        assert h is not None
        p = c.post
        if h.epoch < self.epoch:
            c.sink = "discard"
        elif h.epoch > self.epoch:
            c.sink = "hold"
        elif h.kind == KIND_ABORT:
            self.note(h.seq, h.mask)
            c.sink = "discard"
        elif h.kind == KIND_DATA:
            if p is not None and p.kind == KIND_DATA and (h.seq, h.mask, h.step) == (p.seq, p.mask, p.step):
                self._sink_post(c, p)
            elif h.seq < self.cur_seq or (h.seq == self.cur_seq and h.mask != self.cur_mask
                                          and h.mask & self.cur_mask == self.cur_mask):
                c.sink = "discard"
            else:
                if h.seq == self.cur_seq and h.mask != self.cur_mask:
                    self.note(h.seq, h.mask)
                c.sink = "hold"
        elif h.kind == KIND_P2P:
            if p is not None and p.kind == KIND_P2P and (h.seq, h.tag) == (p.seq, p.tag):
                self._sink_post(c, p)
            else:
                if self._stashed + h.nbytes > self.stash_limit:
                    raise ProtocolError("unexpected point-to-point data over the stash limit")
                self._stashed += h.nbytes
                c.sink, c.dst = "stash", memoryview(bytearray(h.nbytes))
        else:
            raise ProtocolError(f"unexpected frame kind {h.kind}")
        if c.sink != "hold" and h.nbytes == 0:
            self._complete(c)

    def _sink_post(self, c: _Conn, p: Post) -> None:
        assert c.cur is not None
        if c.cur.nbytes != len(p.buf):
            raise ProtocolError(f"rank {c.rank} sent {c.cur.nbytes} bytes, expected {len(p.buf)}")
        c.sink, c.dst = "post", p.buf

    def _complete(self, c: _Conn) -> None:
        h = c.cur
        assert h is not None
        if c.sink == "post" and c.post is not None:
            c.post.done = True
            c.post = None
        elif c.sink == "stash" and c.dst is not None:
            self.stash.setdefault((h.src, h.tag, h.seq), deque()).append(c.dst.obj)  # type: ignore[arg-type]
        c.cur, c.sink, c.dst, c.got = None, "", None, 0

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
        for c in self.conns.values():
            if c.alive and c.sink == "hold":
                try:
                    self._route(c)
                except ProtocolError as exc:
                    log.info("connection to rank %s lost: %s", c.rank, exc)
                    self._lost(c)

    def _lost(self, c: _Conn) -> None:
        if c.events:
            try:
                self._sel.unregister(c.sock)
            except (KeyError, ValueError):
                pass
            c.events = 0
        c.alive = False
        c.outq.clear()
        c.sock.close()
