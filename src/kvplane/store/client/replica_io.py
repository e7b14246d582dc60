"""The store client's data path: replica writes and reads under one deadline per call.

* Every call has one ``Deadline``; the master RPCs and every transfer attempt draw on it, so a
  call never outlives its timeout, however many replicas hang.
* Replica reads fail over: each attempt gets an equal share of what is left (a hung replica
  cannot eat the time of the next one), and is given until ``MARGIN`` before the read lease the
  master granted ends (measured from before the request was sent, so it ends no later than the
  master's). A read is taken only if it ended before that lease did (``ended_in``): a transport
  that overran its timeout, or a stalled segment that served the read late, may have read
  space the master had handed to another object, so those bytes are not returned
  (``LeaseExpired``).
* With checksums on, read bytes are checked against the object's checksum; a mismatch fails
  over to the next replica and, when none is left, raises ``ChecksumMismatch``: it is never
  returned as a success.
* A segment a transfer failed on is remembered (tried last for a while) and reported to the
  master with the next RPC, which then stops placing objects there.

Every function takes the client's ``ClientContext``. Imports the transfer engine, store types
and the client's ``context``, ``timing`` and ``suspects`` layers below it; never binds sockets.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable
from typing import Any, cast

import msgspec
import numpy as np

from kvplane.common.deadline import Deadline
from kvplane.common.errors import KVPlaneError
from kvplane.store.checksum import digest
from kvplane.store.client.context import ClientContext
from kvplane.store.client.timing import GRAIN, MARGIN, coarse, ended_in, lease_bound
from kvplane.store.errors import ChecksumMismatch, InvalidParams, LeaseExpired, TransferFail
from kvplane.store.types import Columns, KeyResult, Replica, Retire
from kvplane.transfer import OpCode, TransferRequest, TransferStatus

log = logging.getLogger(__name__)
OK = TransferStatus.COMPLETED
# One transfer of a call: (the key's index in the call, the replica, READ or WRITE, the registered
# local address, bytes). A plain tuple, not a NamedTuple: a put makes one per replica, and a
# NamedTuple costs CPython 3.11 about 8x a tuple's to build.
Move = tuple[int, Replica, OpCode, int, int]


def ordered(ctx: ClientContext, replicas: list[Replica]) -> list[Replica]:
    """Healthy first, then same host first; otherwise the master's order (suspects last)."""
    if len(replicas) == 1:
        return list(replicas)
    mine = ctx.engine.host_id
    if not ctx.suspects.any():
        return sorted(replicas, key=lambda r: r.host_id != mine)
    return sorted(replicas, key=lambda r: (ctx.suspects.bad(r.segment), r.host_id != mine))


def read_items(ctx: ClientContext, items: list[tuple[int, int, int, int, int]],
               timeout: float) -> list[TransferStatus]:
    """``engine.read_many(items)``; one item through ``read_one``, which ends as
    ``read_many`` would with less Python (over TCP one READ frame, not a vectored job)."""
    if len(items) == 1:
        return [ctx.engine.read_one(*items[0], timeout=timeout)]
    return ctx.engine.read_many(items, timeout)


def run(ctx: ClientContext, moves: list[Move], deadline: Deadline,
        blame_failed: bool = True) -> list[bool]:
    """Run the moves once, all by ``deadline``; True where each completed. The segments of
    those that failed are blamed (``blame``) unless ``blame_failed`` is False."""
    out = [False] * len(moves)
    if deadline.remaining() <= 0:
        return out
    todo: list[tuple[int, int, int, int, int]]  # (handle, local, remote, length, gen)
    ops: list[OpCode]
    where: list[int]
    failed: set[str] = set()
    handles = ctx.handles
    todo, ops, where = [], [], []
    for i, (_, rep, op, addr, size) in enumerate(moves):
        h = handles.get(rep.segment)
        if h is None:
            try:
                h = ctx.segment_handle(rep.segment, deadline)
            except KVPlaneError:  # unreachable segment (or no time left to look it up)
                failed.add(rep.segment)
                continue
        todo.append((h, addr, rep.addr, size, rep.gen))
        ops.append(op)
        where.append(i)
    if todo and deadline.remaining() > 0:
        left = coarse(deadline.remaining())
        if ops.count(OpCode.READ) == len(ops):  # a get: the engine's lean paths
            got = read_items(ctx, todo, left)
        elif len(todo) == 1 and ops[0] == OpCode.WRITE:  # a put of one small object
            got = [ctx.engine.write_one(*todo[0], timeout=left)]
        elif ops.count(OpCode.WRITE) == len(ops):  # a put
            got = ctx.engine.write_many(todo, left)
        else:
            got = ctx.engine.transfer([TransferRequest(op, a, h, r, n, gen=g)
                                          for op, (h, a, r, n, g) in zip(ops, todo)], left)
        for i, st in zip(where, got):
            out[i] = st == OK
    if out.count(True) == len(out) or not blame_failed:
        return out
    blame(ctx, failed | {moves[i][1].segment for i in where if not out[i]})
    return out


def blame(ctx: ClientContext, failed: set[str]) -> None:
    """Segments a transfer failed on: looked up afresh next time (they may have restarted),
    tried last for a while, reported to the master."""
    for seg in failed:
        ctx.handles.pop(seg, None)
    if failed:
        ctx.suspects.add(failed)


def retire(ctx: ClientContext, retire: list[Retire], deadline: Deadline) -> set[int]:
    """Have each segment refuse the generations of the replicas this call replaced or removed
    under a read lease (``types.Retire``): once this returns, no client's held read of them
    succeeds. Returns the key indexes where a segment could not be told (that segment is
    blamed); the master still fences those generations through the owner's heartbeat."""
    by_seg: dict[str, list[tuple[int, int]]] = {}
    for i, seg, gen in retire:
        by_seg.setdefault(seg, []).append((i, gen))
    failed: set[int] = set()
    bad: set[str] = set()
    # at most half the call's time: a stalled segment leaves the rest to the call
    limit = Deadline(time.monotonic() + deadline.remaining() / 2)
    for seg, entries in by_seg.items():
        try:
            h = ctx.segment_handle(seg, limit)
            ctx.engine.retire(h, [g for _, g in entries],
                                 timeout=max(limit.remaining(), 1e-3))
            ctx.retired.add([(seg, g) for _, g in entries])
        except KVPlaneError as exc:
            log.warning("could not retire %d generation(s) at segment %s: %s",
                        len(entries), seg, exc)
            failed.update(i for i, _ in entries)
            bad.add(seg)
    if bad:
        blame(ctx, bad)
    return failed


def write(ctx: ClientContext, moves: list[Move], deadline: Deadline,
          blame_failed: bool = True) -> set[int]:
    """Write every replica; returns the key indexes where one failed."""
    done = run(ctx, moves, deadline, blame_failed)
    return {m[0] for m, ok in zip(moves, done) if not ok}


def put_write(ctx: ClientContext, results: list[KeyResult], ok: list[int], addrs: list[int],
              sizes: list[int], deadline: Deadline, blame_failed: bool = True) -> set[int]:
    """Write the keys ``ok`` of a put, each header in front of its value in every replica
    (``put_moves``, staged in the client's registered memory); returns the indexes that failed."""
    if len(ok) == 1:  # one small object with one replica: one WRITE from this thread's slot
        done = put_small(ctx, results[ok[0]], addrs[ok[0]], sizes[ok[0]], deadline,
                         blame_failed)
        if done is not None:
            return set() if done else set(ok)
    with ctx.staging.block(put_staging(results, ok, sizes) or 1) as (hbase, hv):
        writes = put_moves(results, ok, addrs, sizes, hbase, hv, ctx.engine.memory.view)
        return write(ctx, writes, deadline, blame_failed)


def put_small(ctx: ClientContext, res: KeyResult, addr: int, size: int, deadline: Deadline,
              blame_failed: bool = True) -> bool | None:
    """``put_write`` of one key of at most ``INLINE`` bytes with one replica, with less Python:
    its header and value copied into this thread's staging slot and sent in one WRITE. True
    or False (written or not, its segment blamed as ``run`` does), or None where this way does
    not apply (the caller writes the usual way)."""
    head = res.header
    n = len(head)
    if len(res.replicas) != 1 or not n or size > INLINE:
        return None
    slot = ctx.staging.slot()
    if slot is None:
        return None
    slot.mem[:n] = head
    if not _copy(ctx.engine.memory.view, addr, size, slot.mem[n:n + size]):
        return None
    rep = res.replicas[0]
    if deadline.remaining() <= 0:
        return False
    try:
        h = ctx.segment_handle(rep.segment, deadline)
    except KVPlaneError:  # unreachable segment (or no time left to look it up)
        ok = False
    else:
        ok = ctx.engine.write_one(h, slot.addr, rep.addr - n, n + size, rep.gen,
                                  timeout=coarse(deadline.remaining())) == OK
    if not ok and blame_failed:
        blame(ctx, {rep.segment})
    return ok


def read(ctx: ClientContext, results: list[KeyResult], addrs: list[int], caps: list[int],
         deadline: Deadline, lease_end: float) -> list[int]:
    """Read each key from its replicas with failover; per key the size read or an error code."""
    if not results:
        return []
    got = _read_plain(ctx, results, addrs, caps, deadline, lease_end)
    if got is not None:
        return got
    out = [r.code or r.size for r in results]  # codes are negative, sizes positive
    corrupt: set[int] = set()
    if max(map(operator.sub, out, caps)) > 0:  # some buffer is too small
        for i, r in enumerate(results):
            if not r.code and r.size > caps[i]:
                out[i] = InvalidParams.code
    todo = {i: ordered(ctx, r.replicas) for i, r in enumerate(results) if out[i] > 0}
    lease = lease_bound(deadline, lease_end)
    check = ctx.config.checksum
    read_op = OpCode.READ
    while todo and lease.remaining() > 0:
        share = lease.remaining() / max(map(len, todo.values()))
        attempt = Deadline(min(lease.at, time.monotonic() + share))
        moves = [(i, reps.pop(0), read_op, addrs[i], results[i].size) for i, reps in todo.items()]
        done = run(ctx, moves, attempt)
        if not ended_in(lease_end):  # read too late: maybe another object's bytes
            done = [False] * len(done)
            for reps in todo.values():
                reps.clear()  # (nothing to fail over to: the lease is over)
        if not check and done.count(True) == len(done):  # the usual case: every key read
            todo.clear()
            break
        for m, ok in zip(moves, done):
            i = m[0]
            if ok and check and not verified(ctx, results[i], addrs[i]):
                ok = False
                corrupt.add(i)
                ctx.corrupt_reads += 1
            if ok:
                todo.pop(i)
            elif not todo[i]:
                todo.pop(i)
                out[i] = _failure(i in corrupt, lease_end)
    for i in todo:  # time ran out with replicas left to try
        out[i] = _failure(i in corrupt, lease_end)
    return out


def _read_plain(ctx: ClientContext, results: list[KeyResult], addrs: list[int],
                caps: list[int], deadline: Deadline, lease_end: float) -> list[int] | None:
    """:func:`read` of the usual batch in one pass, a list at a time: every key found with
    one replica, on a segment already open, into a buffer big enough, checksums off. None
    when the batch is not like that (``read`` then goes key by key). With one replica per
    key there is nothing to fail over to: a key whose read failed fails, as in ``read``."""
    if ctx.config.checksum or not all(len(r.replicas) == 1 for r in results):
        return None  # (a miss has no replica)
    reps = [r.replicas[0] for r in results]
    handles = ctx.handles
    hs = [handles.get(rep.segment) for rep in reps]
    sizes = [r.size for r in results]
    if None in hs or max(map(operator.sub, sizes, caps)) > 0:
        return None
    lease = lease_bound(deadline, lease_end)
    if lease.remaining() <= 0:
        return None
    items = [(h, a, rep.addr, n, rep.gen) for h, a, rep, n in
             zip(cast("list[int]", hs), addrs, reps, sizes)]
    return _one_pass(ctx, items, sizes, lease, lease_end, lambda i: reps[i].segment)


def read_columns(ctx: ClientContext, cols: Columns, addrs: list[int], caps: list[int],
                 deadline: Deadline, lease_end: float) -> list[int] | None:
    """:func:`_read_plain` of a :class:`Columns` answer, with no ``KeyResult`` made. None when
    a segment is not open yet, a buffer is too small or the lease is over (``read`` of
    ``column_results`` then does it key by key)."""
    handles = ctx.handles
    found = [handles.get(name) for name in cols.segments]
    sizes = cols.size
    if None in found or max(map(operator.sub, sizes, caps)) > 0:
        return None
    hs = cast("list[int]", found)  # (every segment open)
    lease = lease_bound(deadline, lease_end)
    if lease.remaining() <= 0:
        return None
    if len(hs) == 1:
        h = hs[0]
        items = [(h, a, r, n, g) for a, r, n, g in zip(addrs, cols.addr, sizes, cols.gen)]
    else:
        items = [(hs[s], a, r, n, g) for s, a, r, n, g in zip(cols.seg, addrs, cols.addr, sizes,
                                                                 cols.gen)]
    return _one_pass(ctx, items, sizes, lease, lease_end, lambda i: cols.segments[cols.seg[i]])


def _one_pass(ctx: ClientContext, items: list[tuple[int, int, int, int, int]],
              sizes: list[int], lease: Deadline, lease_end: float,
              segment_of: Callable[[int], str]) -> list[int]:
    """One ``read_many`` of one item per key: per key its size, or the failure of a key whose
    read failed (nothing to fail over to; its segment, ``segment_of(i)``, is blamed)."""
    got = read_items(ctx, items, coarse(lease.remaining()))
    out = list(sizes)
    if not ended_in(lease_end):  # read too late: maybe another object's bytes
        return [LeaseExpired.code] * len(out)
    if got.count(OK) == len(got):
        return out
    bad = [i for i, st in enumerate(got) if st != OK]
    blame(ctx, {segment_of(i) for i in bad})
    for i in bad:
        out[i] = _failure(False, lease_end)
    return out


def _failure(corrupt: bool, lease_end: float) -> int:
    if corrupt:
        return ChecksumMismatch.code
    # the lease ran out (to within the margin and the rounding of the last attempt's timeout)
    return LeaseExpired.code if time.monotonic() >= lease_end - MARGIN - GRAIN \
        else TransferFail.code


def verified(ctx: ClientContext, result: KeyResult, addr: int) -> bool:
    """False if checksums are on and the bytes at ``addr`` do not match ``result``'s."""
    if not (ctx.config.checksum and result.checksum):
        return True
    return digest(ctx.engine.memory.view(addr, result.size)) == result.checksum


INLINE = 64 << 10  # values up to this size travel in one WRITE with their header


def _copy(value_of: Callable[[int, int], Any], addr: int, n: int, into: memoryview) -> bool:
    """Copy ``n`` bytes at ``addr`` into ``into`` (bytes); False where they have no memory
    view (a file region: the value then goes in its own WRITE)."""
    try:
        src = value_of(addr, n)
    except KVPlaneError:
        return False
    try:
        into[:] = src
    except (TypeError, ValueError):  # a view in another format than bytes
        np.frombuffer(into, np.uint8)[:] = np.frombuffer(src, np.uint8)
    return True


def put_staging(results: list[KeyResult], ok: list[int], sizes: list[int]) -> int:
    """Bytes of staging ``put_moves`` needs: every header, and the values sent inline."""
    return sum(len(results[i].header) + (sizes[i] if results[i].header and sizes[i] <= INLINE
                                         else 0) for i in ok)


def put_moves(results: list[KeyResult], ok: list[int], addrs: list[int], sizes: list[int],
              hbase: int, hview: np.ndarray, value_of: Callable[[int, int], Any]) -> list[Move]:
    """The WRITEs of a put: per replica its inventory header (copied into ``hview``, registered
    at ``hbase``) just in front of the value, then the value itself. A small value is copied
    behind its header in ``hview`` and both go in one WRITE (one request instead of two: the
    header costs a put almost nothing); ``value_of(addr, n)`` gives its bytes."""
    out: list[Move] = []
    at = 0
    hmem = hview.data.cast("B")  # byte-wise copies into it cost no numpy call
    for i in ok:
        res = results[i]
        head = res.header
        n = len(head)
        if n:
            hmem[at:at + n] = head
        if n and sizes[i] <= INLINE and _copy(value_of, addrs[i], sizes[i],
                                               hmem[at + n:at + n + sizes[i]]):
            out += [(i, msgspec.structs.replace(rep, addr=rep.addr - n, size=n + sizes[i]),
                     OpCode.WRITE, hbase + at, n + sizes[i]) for rep in res.replicas]
            at += n + sizes[i]
            continue
        for rep in res.replicas:
            if n:
                out.append((i, msgspec.structs.replace(rep, addr=rep.addr - n, size=n),
                            OpCode.WRITE, hbase + at, n))
            out.append((i, rep, OpCode.WRITE, addrs[i], sizes[i]))
        at += n
    return out
