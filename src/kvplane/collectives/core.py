"""GroupCore: the state and communication thread of one fault-tolerant process group.

Owns the mesh, the heartbeat and the membership of one group: committed ``active`` mask and
epoch, the locally observed ``dead`` mask, per-epoch sequence numbers. Every operation, data or
membership, runs on the single communication thread in submission order, so the mesh is never
touched concurrently. Knows nothing about torch.distributed's ProcessGroup API (see
``process_group.py``).
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from kvplane.collectives.frames import KIND_DATA, KIND_P2P, MAX_SLOTS, Header, bits, ranks_of
from kvplane.collectives.heartbeat import Heartbeat
from kvplane.collectives.membership import Board, Decision, Endpoint, View, decide
from kvplane.collectives.mesh import AttemptFailed, Mesh, Post
from kvplane.collectives.ops import Attempt, byte_view
from kvplane.common import log as events
from kvplane.common.errors import InvalidArgument, Timeout, Unavailable

log = logging.getLogger(__name__)
T = TypeVar("T")
_STOP = object()
_COMMIT_STEP = 0xFFFFFFFF  # header step of the empty DONE frames that end every attempt


@dataclass(frozen=True)
class Settings:
    """Tunables of one group (see ``KvplaneOptions`` for the user-facing fields).

    Attributes:
        timeout: default per-op deadline in seconds.
        heartbeat_interval: seconds between heartbeats.
        heartbeat_timeout: a peer silent this long is treated as failed.
        max_message: largest frame payload accepted from a peer, in bytes.
        is_extension: start outside the group and wait for :meth:`GroupCore.join`.
    """

    timeout: float
    heartbeat_interval: float
    heartbeat_timeout: float
    max_message: int
    is_extension: bool


@dataclass(frozen=True)
class OpResult:
    """How one operation went on this rank.

    Attributes:
        participants: mask of the ranks whose contributions are in the result.
        active: committed active mask when the op ran.
    """

    participants: int
    active: int

    @property
    def failed(self) -> int:
        """Mask of active ranks that did not take part."""
        return self.active & ~self.participants


class GroupCore:
    """Connections, membership and the communication thread of one group.

    Args:
        store: the group's store (a PrefixStore from torch).
        rank: this process's slot.
        size: number of slots.
        settings: tunables.

    Raises:
        InvalidArgument: more than 64 slots.
        Timeout: peers did not publish or connect within ``settings.timeout``.
    """

    def __init__(self, store: dist.Store, rank: int, size: int, settings: Settings) -> None:
        if not 0 < size <= MAX_SLOTS:
            raise InvalidArgument(f"group size must be 1..{MAX_SLOTS}, got {size}")
        self.rank, self.size, self.settings = rank, size, settings
        self.board = Board(store)
        self.inc = secrets.randbits(31)
        self.mesh = Mesh(rank, settings.max_message, stash_limit=max(settings.max_message, 64 << 20))
        self.hb = Heartbeat(rank, self.inc, settings.heartbeat_interval, settings.heartbeat_timeout)
        self.me = Endpoint(self.mesh.port, self.hb.port, self.inc)
        self.epoch = 0
        self.seq = 0
        self.dead = 0
        self.active_ranks = torch.zeros(size, dtype=torch.int32)
        self.eps: dict[int, Endpoint] = {}
        self._p2p_out: dict[tuple[int, int], int] = defaultdict(int)
        self._p2p_in: dict[tuple[int, int], int] = defaultdict(int)
        self._q: queue.Queue[object] = queue.Queue()
        self._closed = False
        self.on_dead: list[Callable[[int, int | None], None]] = []  # (rank, incarnation) of a failed peer
        deadline = time.monotonic() + settings.timeout
        self._join_from = -1
        try:
            if settings.is_extension:
                self._set_active(1 << rank)
                # any decision that admits us comes at or after this epoch
                self._join_from = self.board.epoch(deadline)
                self.board.put_addr(rank, self.me, joining=True)
            else:
                self._bootstrap(deadline)
        except BaseException:
            self.hb.close()
            self.mesh.close()
            raise
        self._thread = threading.Thread(target=self._loop, name=f"kvplane-pg-{rank}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ setup
    def _bootstrap(self, deadline: float) -> None:
        self.board.put_addr(self.rank, self.me)
        if self.rank == 0:
            self.board.set_epoch(0)
        eps = {r: self.board.addr(r, deadline) for r in range(self.size) if r != self.rank}
        for r in range(self.rank):
            self.mesh.connect(r, eps[r].port, self.inc, deadline)
        self.mesh.accept(set(range(self.rank + 1, self.size)), deadline)
        self.eps = eps
        self._set_active((1 << self.size) - 1)
        self.hb.set_peers({r: (e.udp, e.inc) for r, e in eps.items()})

    def _set_active(self, mask: int) -> None:
        self.active = mask
        for r in range(self.size):
            self.active_ranks[r] = mask >> r & 1

    # ------------------------------------------------------------------ thread
    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Queue ``fn`` for the communication thread (non-blocking, any thread).

        Raises:
            Unavailable: the group has been shut down.
        """
        if self._closed:
            raise Unavailable("process group is shut down")
        fut: Future[T] = Future()
        self._q.put((fn, fut))
        return fut

    def call(self, fn: Callable[[], T], timeout: float) -> T:
        """Run ``fn`` on the communication thread and wait for it.

        Raises:
            Timeout: the result did not arrive in ``timeout`` seconds.
        """
        fut = self.submit(fn)
        try:
            return fut.result(timeout=timeout)
        except TimeoutError as exc:
            raise Timeout(f"operation did not finish in {timeout:.2f}s") from exc

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is _STOP:
                return
            fn, fut = cast("tuple[Callable[[], Any], Future[Any]]", item)  # not _STOP: a job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # delivered to the waiter, never lost
                fut.set_exception(exc)

    def close(self, timeout: float = 5.0) -> None:
        """Drain the queue, stop the thread, close sockets (idempotent, any thread but the comm one)."""
        if self._closed:
            return
        self._closed = True
        self._q.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=timeout)
        self.hb.close()
        self.mesh.close()

    # ------------------------------------------------------------------ data ops (comm thread)
    def stale(self, rank: int) -> bool:
        """True if ``rank`` sent neither heartbeats nor data for ``heartbeat_timeout`` seconds.

        Data counts as a sign of life too, so a rank whose heartbeat thread is starved on a
        loaded machine while it streams is not evicted.
        """
        return self.hb.stale(rank) and time.monotonic() - self.mesh.last_rx(rank) > self.hb.timeout

    def collective(self, body: Callable[[Attempt], None], restore: Callable[[], None] | None,
                   timeout: float | None) -> OpResult:
        """Run one collective, restarting it over the survivors until it completes.

        Args:
            body: runs one attempt.
            restore: puts the inputs back before a restart (None if the body never mutates them).
            timeout: op deadline in seconds (None: the group default).

        Raises:
            Unavailable: this rank was excluded by its peers.
        """
        t = self.settings.timeout if timeout is None else timeout
        deadline = time.monotonic() + t
        seq, self.seq = self.seq, self.seq + 1
        active = self.active
        mask = active & ~self.dead
        restarted = False
        while True:
            if not mask >> self.rank & 1:
                raise Unavailable(f"rank {self.rank} was excluded from op {seq} by its peers")
            if restarted and restore is not None:
                restore()
            self.mesh.begin(seq, mask)
            ranks = ranks_of(mask)
            try:
                body(Attempt(self.mesh, ranks, ranks.index(self.rank), deadline, self.stale))
                late = self._commit(ranks, deadline)
                break
            except AttemptFailed as f:
                mask &= ~f.exclude
                log.info("rank %s op %s: %s; restarting over %s", self.rank, seq, f.reason, ranks_of(mask))
                self.mesh.abandon(mask)
                deadline = max(deadline, time.monotonic() + min(1.0, t / 2))
                restarted = True
        self._mark_dead((active & ~mask) | late)
        if restarted or late:
            self.mesh.flush(time.monotonic() + 0.2)
        return OpResult(mask, active)

    def _commit(self, ranks: list[int], deadline: float) -> int:
        """Agree that the attempt's data phase finished everywhere before anyone leaves the op.

        Every participant sends an empty DONE frame to every other and waits for theirs. A peer
        that fails now has already delivered its data, so the result stands (it is returned as a
        mask of such *late* failures, to be skipped from the next op on). An ABORT from a peer
        still in its data phase restarts the attempt, which is why nobody may leave before
        hearing from every survivor.

        Raises:
            AttemptFailed: a peer restarted the attempt (evidence).
        """
        peers = [r for r in ranks if r != self.rank]
        if not peers:
            return 0
        empty = memoryview(b"")
        m = self.mesh
        sends = [(p, m.data_header(_COMMIT_STEP, 0), empty) for p in peers if m.alive(p)]
        waiting, late = set(peers), 0
        while waiting:
            gone = {p for p in waiting if not m.alive(p)}
            late |= bits(gone)
            waiting -= gone
            if not waiting:
                break
            posts = [(p, Post(KIND_DATA, m.cur_seq, m.cur_mask, _COMMIT_STEP, 0, empty))
                     for p in sorted(waiting)]
            try:
                m.exchange(sends, posts, deadline, self.stale)
                waiting.clear()
            except AttemptFailed as f:
                if f.evidence:
                    raise
                waiting -= {p for p, post in posts if post.done}
                gone = waiting & set(ranks_of(f.exclude))
                late |= bits(gone)
                waiting -= gone
            sends = []
        return late

    def _mark_dead(self, mask: int) -> None:
        new = mask & ~self.dead
        if new:
            self.dead |= new
            for r in ranks_of(new):
                self.mesh.drop(r)
                ep = self.eps.get(r)
                for fn in self.on_dead:
                    fn(r, None if ep is None else ep.inc)
            events.event("collectives.peer_failed", rank=self.rank, failed=ranks_of(new), epoch=self.epoch)

    def p2p(self, t: torch.Tensor, peer: int, tag: int, send: bool, timeout: float | None) -> OpResult:
        """Send ``t`` to or receive it from ``peer`` (point to point; completes on peer failure)."""
        if not 0 <= peer < self.size or peer == self.rank:
            raise InvalidArgument(f"bad peer rank {peer}")
        t_ = self.settings.timeout if timeout is None else timeout
        deadline = time.monotonic() + t_
        mv = byte_view(t)
        key = (peer, tag)
        try:
            if send:
                n, self._p2p_out[key] = self._p2p_out[key], self._p2p_out[key] + 1
                hdr = Header(KIND_P2P, self.rank, self.epoch, n, 0, 0, tag, len(mv))
                self.mesh.exchange([(peer, hdr, mv)], [], deadline, self.stale)
            else:
                n, self._p2p_in[key] = self._p2p_in[key], self._p2p_in[key] + 1
                self.mesh.exchange([], [(peer, Post(KIND_P2P, n, 0, 0, tag, mv))], deadline, self.stale)
        except AttemptFailed:
            self._mark_dead(1 << peer)
            return OpResult(self.active & ~(1 << peer), self.active)
        return OpResult(self.active, self.active)

    # ------------------------------------------------------------------ membership (comm thread)
    def sync_view(self, timeout: float | None, admit: bool = True, drop: int = 0,
                  only: int | None = None) -> Decision:
        """Agree on the next epoch's membership with the other members (collective).

        Args:
            timeout: seconds to wait for peers' views (None: group default).
            admit: admit pending replacement processes.
            drop: mask of ranks to deactivate.
            only: if set, admit only these slots (mask).

        Raises:
            Unavailable: the decision excluded this rank.
            Timeout: the store did not answer in time.
        """
        deadline = time.monotonic() + (self.settings.timeout if timeout is None else timeout)
        e = self.epoch
        stale = bits([r for r in ranks_of(self.active) if r != self.rank and self.stale(r)])
        reach = (self.active & ~self.dead & ~stale) | 1 << self.rank
        joins: dict[int, int] = {}
        if admit:
            free = [r for r in range(self.size) if not reach >> r & 1]
            if only is not None:
                free = [r for r in free if only >> r & 1]
            joins = {r: ep.inc for r, ep in self.board.join_requests(free).items()}
        self.board.post_view(e, self.rank, View(reach, joins, drop))
        views = self.board.collect_views(e, ranks_of(reach & ~(1 << self.rank)), deadline)
        views[self.rank] = View(reach, joins, drop)
        decision = self.board.propose(e, decide(views))
        self.board.set_epoch(e + 1)
        self._adopt(e + 1, decision, deadline)
        return decision

    def _adopt(self, epoch: int, d: Decision, deadline: float) -> None:
        if not d.active >> self.rank & 1:
            raise Unavailable(f"rank {self.rank} is not in the membership of epoch {epoch}")
        for r in ranks_of(self.active & ~d.active):
            self.mesh.drop(r)
            self.eps.pop(r, None)
        for r, inc in d.admitted.items():
            if r == self.rank:
                continue
            ep = self.board.addr(r, deadline, joining=True)
            if ep.inc != inc:
                raise Unavailable(f"join request of rank {r} changed while admitting it")
            self.mesh.drop(r)
            self.mesh.connect(r, ep.port, self.inc, deadline)
            self.eps[r] = ep
        self.dead &= d.active & ~bits(list(d.admitted))
        self._enter(epoch, d.active)
        events.event("collectives.membership", rank=self.rank, epoch=epoch, active=ranks_of(d.active),
                     admitted=sorted(d.admitted))

    def _enter(self, epoch: int, active: int) -> None:
        self.epoch = epoch
        self.seq = 0
        self._p2p_out.clear()
        self._p2p_in.clear()
        self.mesh.set_epoch(epoch)
        self._set_active(active)
        self.hb.set_peers({r: (self.eps[r].udp, self.eps[r].inc) for r in ranks_of(active) if r != self.rank})

    def join(self, timeout: float | None) -> None:
        """Wait until the members admit this replacement process, then connect (blocking).

        Raises:
            Timeout: no decision admitted this process in time.
        """
        deadline = time.monotonic() + (self.settings.timeout if timeout is None else timeout)
        if self._join_from < 0:
            raise InvalidArgument("only a process started with is_extension=True can join")
        e = self._join_from
        while True:
            d = self.board.decision(e, deadline)
            if d.admitted.get(self.rank) == self.inc:
                break
            e += 1
        members = [r for r in ranks_of(d.active) if r != self.rank]
        eps = {r: self.board.addr(r, deadline, joining=r in d.admitted) for r in members}
        lower = {r for r in d.admitted if r < self.rank}
        for r in sorted(lower):
            self.mesh.connect(r, eps[r].port, self.inc, deadline)
        self.mesh.accept(set(members) - lower, deadline)
        self.eps = eps
        self.board.put_addr(self.rank, self.me)
        self.board.clear_join(self.rank)  # a later failure of ours must not re-admit this request
        self._enter(e + 1, d.active)
        events.event("collectives.joined", rank=self.rank, epoch=e + 1, active=ranks_of(d.active))

