"""Collective algorithms on CPU tensors over a :class:`~kvplane.collectives.mesh.Mesh` attempt.

Ring reduce-scatter + ring allgather for allreduce (each rank sends ``2(n-1)/n`` of the buffer),
ring allgather, ring reduce-scatter, binomial-tree broadcast and pairwise all-to-all. Every
function runs one *attempt* over a fixed participant list; the caller restarts it with fewer
participants when :class:`~kvplane.collectives.mesh.AttemptFailed` escapes.

Reductions fold in the fixed order of :func:`kvplane.collectives.schedule.reduction_order`, so
results are identical on every rank and reproducible. Tensors must be contiguous and 1-D here;
the process group flattens them. Must not touch sockets directly (only through ``Attempt``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvplane.collectives import schedule
from kvplane.collectives.frames import KIND_DATA
from kvplane.collectives.mesh import Mesh, Post, StreamRecv, StreamSend
from kvplane.collectives.shm import Area, AreaId, ShmArena
from kvplane.common.errors import InvalidArgument

# reduce kinds (torch's RedOpType names, lower case)
SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR = "sum", "avg", "product", "min", "max", "band", "bor", "bxor"

_FOLD: dict[str, Callable[..., torch.Tensor]] = {
    SUM: torch.add, AVG: torch.add, PRODUCT: torch.mul, MIN: torch.minimum, MAX: torch.maximum,
    BAND: torch.bitwise_and, BOR: torch.bitwise_or, BXOR: torch.bitwise_xor,
}


def check_reduce(op: str, dtype: torch.dtype) -> None:
    """Reject reductions the dtype cannot do.

    Raises:
        InvalidArgument: an unknown op, AVG on a non-floating dtype, or a bitwise op on floats.
    """
    if op not in _FOLD:
        raise InvalidArgument(f"unsupported reduce op {op!r}; valid: {sorted(_FOLD)}")
    if op == AVG and not (dtype.is_floating_point or dtype.is_complex):
        raise InvalidArgument(f"AVG needs a floating dtype, got {dtype}")
    if op in (BAND, BOR, BXOR) and (dtype.is_floating_point or dtype.is_complex):
        raise InvalidArgument(f"{op} needs an integer or bool dtype, got {dtype}")


def fold(op: str, acc: torch.Tensor, other: torch.Tensor, out: torch.Tensor | None = None) -> None:
    """``out = acc op other`` (``out`` defaults to ``acc``; it may alias either input)."""
    dst = acc if out is None else out
    if acc.dtype == torch.bool and op in (SUM, AVG):
        torch.logical_or(acc, other, out=dst)
    else:
        _FOLD[op](acc, other, out=dst)


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte memoryview over a contiguous tensor's storage (zero copy)."""
    if t.numel() == 0:
        return memoryview(bytearray(0))
    return t.reshape(-1).view(torch.uint8).numpy().data.cast("B")


@dataclass
class Attempt:
    """One attempt of one collective over a fixed participant list.

    Attributes:
        mesh: the mesh, already ``begin``-ed with this attempt's seq and mask.
        ranks: participating ranks, ascending; positions index this list.
        pos: this rank's position.
        deadline: monotonic deadline of the op.
        stale: heartbeat verdict on a rank.
    """

    mesh: Mesh
    ranks: list[int]
    pos: int
    deadline: float
    stale: Callable[[int], bool]

    @property
    def n(self) -> int:
        """Number of participants."""
        return len(self.ranks)

    def step(self, step: int, send: tuple[int, torch.Tensor] | None = None,
             recv: tuple[int, torch.Tensor] | None = None) -> None:
        """Send to and/or receive from positions, blocking until both are done.

        Raises:
            AttemptFailed: from the mesh.
        """
        sends, posts = [], []
        if send is not None:
            mv = byte_view(send[1])
            sends.append((self.ranks[send[0]], self.mesh.data_header(step, len(mv)), mv))
        if recv is not None:
            mv = byte_view(recv[1])
            m = self.mesh
            posts.append((self.ranks[recv[0]], Post(KIND_DATA, m.cur_seq, m.cur_mask, step, 0, mv)))
        self.mesh.exchange(sends, posts, self.deadline, self.stale)

    def share(self, step: int, value: int) -> list[int]:
        """Tell every other participant ``value`` (unsigned 128-bit) and hear theirs.

        Also a barrier: it returns only after every participant reached it (or raises).

        Returns:
            Each position's value (this rank's included).

        Raises:
            AttemptFailed: from the mesh.
        """
        m = self.mesh
        mine = memoryview(value.to_bytes(16, "little"))
        got = [memoryview(bytearray(16)) for _ in self.ranks]
        others = [k for k in range(self.n) if k != self.pos]
        sends = [(self.ranks[k], m.data_header(step, 16), mine) for k in others]
        posts = [(self.ranks[k], Post(KIND_DATA, m.cur_seq, m.cur_mask, step, 0, got[k])) for k in others]
        m.exchange(sends, posts, self.deadline, self.stale)
        got[self.pos] = mine
        return [int.from_bytes(v, "little") for v in got]


SEGMENT_BYTES = 4 << 20  # ring blocks are streamed in segments of this size: a rank folds and forwards
# the first segment of a block while the rest arrives (32 MiB meant no pipelining below 128 MiB)


class _Ring:
    """Builds the pipelined frame lists of one ring pass (reduce-scatter and/or allgather).

    Every block is cut into the same number ``k`` of segments; frame ``(step, seg)`` carries
    header step ``step * k + seg``. A segment is forwarded as soon as it arrived (and was folded),
    so the ring streams instead of moving one whole block per step.
    """

    def __init__(self, a: Attempt, blocks: list[torch.Tensor]) -> None:
        self.a, self.blocks = a, blocks
        biggest = max(b.numel() * b.element_size() for b in blocks)
        self.k = max(1, -(-biggest // SEGMENT_BYTES))
        self.sends: list[StreamSend] = []
        self.recvs: list[StreamRecv] = []
        self.rs_last: dict[int, int] = {}  # segment -> index of its last reduce-scatter receive

    def seg(self, t: torch.Tensor, j: int) -> torch.Tensor:
        """Segment ``j`` of block-shaped tensor ``t``."""
        lo, hi = schedule.split(t.numel(), self.k)[j]
        return t[lo:hi]

    def reduce_scatter(self, op: str, scratch: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor,
                       before_write: Callable[[], None] | None) -> None:
        """Add the reduce-scatter frames; block ``pos`` reduced lands in ``out`` segment by segment."""
        a, n, k = self.a, self.a.n, self.k
        steps = schedule.ring_reduce_scatter(a.pos, n)
        for s, (sb, rb) in enumerate(steps):
            last = s == len(steps) - 1
            for j in range(k):
                prev = self.blocks[sb] if s == 0 else scratch[(s - 1) % 2][: self.blocks[sb].numel()]
                src = self.seg(prev, j)
                self.sends.append(StreamSend(s * k + j, byte_view(src), (s - 1) * k + j if s else -1))
                buf = self.seg(scratch[s % 2][: self.blocks[rb].numel()], j)
                dst = self.seg(out, j) if last else buf
                hook = before_write if last and j == 0 else None
                done = _folder(op, buf, self.seg(self.blocks[rb], j), dst, hook,
                               n if last and op == AVG else 0)
                self.recvs.append(StreamRecv(s * k + j, byte_view(buf), done,
                                             (s - 1) * k + j if s >= 2 else -1))
                if last:
                    self.rs_last[j] = len(self.recvs) - 1

    def allgather(self, base: int) -> None:
        """Add the allgather frames (header steps from ``base``); forwards follow their arrival."""
        a, n, k = self.a, self.a.n, self.k
        first = len(self.recvs)
        for t, (sb, rb) in enumerate(schedule.ring_allgather(a.pos, n)):
            for j in range(k):
                if t == 0:
                    dep = self.rs_last.get(j, -1)
                else:
                    dep = first + (t - 1) * k + j
                step = base + t * k + j
                self.sends.append(StreamSend(step, byte_view(self.seg(self.blocks[sb], j)), dep))
                self.recvs.append(StreamRecv(step, byte_view(self.seg(self.blocks[rb], j))))

    def run(self) -> None:
        """Stream every frame to the right-hand and from the left-hand neighbour."""
        a = self.a
        a.mesh.stream(a.ranks[(a.pos + 1) % a.n], self.sends, a.ranks[(a.pos - 1) % a.n], self.recvs,
                      a.deadline, a.stale)


def _folder(op: str, buf: torch.Tensor, own: torch.Tensor, dst: torch.Tensor,
            hook: Callable[[], None] | None, divide: int) -> Callable[[], None]:
    """The callback of one reduce-scatter receive: ``dst = buf op own`` (then ``/ divide``)."""
    def run() -> None:
        if hook is not None:
            hook()
        fold(op, buf, own, out=dst)
        if divide:
            dst.div_(divide)
    return run


def allreduce(a: Attempt, flat: torch.Tensor, op: str, scratch: tuple[torch.Tensor, torch.Tensor],
              before_write: Callable[[], None] | None = None) -> None:
    """In-place allreduce of ``flat`` over the attempt's participants (pipelined ring RS + AG).

    ``scratch`` holds two buffers of at least ``ceil(numel / n)`` elements of ``flat.dtype``.
    The reduce-scatter half only reads ``flat``; ``before_write`` runs before it is first
    written (a caller keeping a copy for restarts waits for the copy there).
    """
    n, i = a.n, a.pos
    if n == 1:
        return
    blocks = [flat[lo:hi] for lo, hi in schedule.split(flat.numel(), n)]
    ring = _Ring(a, blocks)
    ring.reduce_scatter(op, scratch, blocks[i], before_write)
    ring.allgather((n - 1) * ring.k)
    ring.run()


# header steps of the shared-memory allreduce's two agreements (ring steps are small numbers)
_SHM_PUBLISHED, _SHM_REDUCED = 0xFFFFFF00, 0xFFFFFF01


def allreduce_shm(a: Attempt, flat: torch.Tensor, op: str, arena: ShmArena,
                  incs: list[int | None]) -> bool:
    """In-place allreduce of ``flat`` through shared memory (every participant on this host).

    1. Each participant copies its input into its area (the copy an exact restart needs, too).
    2. All tell each other which area (:class:`~kvplane.collectives.shm.AreaId`), which also
       says that they published.
    3. Position ``i`` reduces block ``i`` from every participant's area, in the ring's
       :func:`~kvplane.collectives.schedule.reduction_order` (so the bytes are the ring's), into
       its area's result.
    4. All agree that every block is reduced.
    5. Each participant copies every block's result into ``flat``.

    ``flat`` is written only in step 5, after the last exchange, so a failure raised from here
    leaves it untouched. If a participant cannot take part all learn it at step 2 or 4 and
    return False, ``flat`` untouched; the caller then runs the TCP ring. No room in
    ``/dev/shm`` for one of them sends this size class and up to the ring for good (every rank
    drops its area); an area someone could not map makes every owner start a new one. The
    caller's commit round keeps anyone from reusing its area before everyone has read it.

    Args:
        incs: incarnation id of each position's rank (None if unknown).

    Raises:
        AttemptFailed: from the mesh (a participant failed).
    """
    n, me, size = a.n, a.pos, flat.element_size()
    nbytes = flat.numel() * size
    own = arena.own(nbytes) if None not in incs else None
    if own is not None:
        own.inputs[:nbytes].copy_(flat.view(torch.uint8))
    said = a.share(_SHM_PUBLISHED, 0 if own is None or arena.id is None else arena.id.pack())
    if 0 in said:
        arena.refuse(nbytes)  # someone has no room for it: not again, and free ours
        return False
    areas = [own if k == me else arena.peer(incs[k], AreaId.unpack(v))  # type: ignore[arg-type]  # None only where refused
             for k, v in enumerate(said)]
    ok = all(x is not None and x.cap >= nbytes for x in areas)
    spans = schedule.split(flat.numel(), n)
    if ok:
        _reduce_block(areas, me, spans[me], flat.dtype, nbytes, op)  # type: ignore[arg-type]  # ok
    if 0 in a.share(_SHM_REDUCED, int(ok)):
        arena.renew()  # someone could not map an area: every owner starts a new generation
        return False
    for k, (lo, hi) in enumerate(spans):
        flat[lo:hi].copy_(areas[k].result[:(hi - lo) * size].view(flat.dtype))  # type: ignore[union-attr]  # ok: none is None
    return True


def _reduce_block(areas: list[Area], me: int, span: tuple[int, int], dtype: torch.dtype,
                  nbytes: int, op: str) -> None:
    """Block ``me`` of every area's input, folded in the ring's order, into area ``me``'s result."""
    n, (lo, hi) = len(areas), span
    parts = [areas[k].inputs[:nbytes].view(dtype)[lo:hi] for k in schedule.reduction_order(me, n)]
    acc = areas[me].result[:(hi - lo) * dtype.itemsize].view(dtype)
    fold(op, parts[0], parts[1], out=acc)
    for other in parts[2:]:
        fold(op, acc, other, out=acc)
    if op == AVG:
        acc.div_(n)


def restore_from_shm(flat: torch.Tensor, arena: ShmArena) -> None:
    """Put back the input :func:`allreduce_shm` published (before a restart)."""
    nbytes = flat.numel() * flat.element_size()
    own = arena.own(nbytes)
    if own is None:  # pragma: no cover - own() keeps an area that holds nbytes
        raise RuntimeError("the published input is gone")
    flat.view(torch.uint8).copy_(own.inputs[:nbytes])


def reduce_scatter(a: Attempt, blocks: list[torch.Tensor], out: torch.Tensor, op: str,
                   scratch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """``out = reduce(blocks[pos] over participants)``; ``blocks`` has one input per position."""
    if a.n == 1:
        out.copy_(blocks[0])
        return
    ring = _Ring(a, blocks)
    ring.reduce_scatter(op, scratch, out, None)
    ring.run()


def allgather(a: Attempt, blocks: list[torch.Tensor]) -> None:
    """Ring allgather: on entry ``blocks[pos]`` is this rank's input; on exit all are filled."""
    if a.n == 1:
        return
    ring = _Ring(a, blocks)
    ring.allgather(0)
    ring.run()


def broadcast(a: Attempt, t: torch.Tensor, root: int) -> None:
    """Binomial-tree broadcast of ``t`` from position ``root``."""
    n = a.n
    v = (a.pos - root) % n
    for level, action, peer in schedule.tree_broadcast(v, n):
        p = (peer + root) % n
        if action == "send":
            a.step(level, send=(p, t))
        else:
            a.step(level, recv=(p, t))


def alltoall(a: Attempt, sends: list[torch.Tensor], recvs: list[torch.Tensor]) -> None:
    """Pairwise exchange: ``recvs[p]`` receives what position ``p`` sends to this rank."""
    recvs[a.pos].copy_(sends[a.pos])
    for s, (to, frm) in enumerate(schedule.pairwise(a.pos, a.n)):
        a.step(s, send=(to, sends[to]), recv=(frm, recvs[frm]))
