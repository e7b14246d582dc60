"""The engine's item paths: ``read_many``/``write_many``/``read_one``/``write_one`` without
the batch and slice bookkeeping, where a transport offers the capability.

Owns :class:`ItemPaths`: per segment, the items a vectored transport (``VectoredIO``) serves
become one :class:`~kvplane.transfer.jobs.PeerJob` (built a list at a time when every item
lies in one local and one remote region), run per transport in one call; one item goes
through a transport's one-item fast path (``OneItemIO``, or ``MappedOneIO`` for a region the
transport maps: a same-host copy); anything else goes through the
engine's ``transfer``. Also owns the request and byte counters (one update per kind). Knows
transports only through the seam and the ``TransportSet``; never imports a transport module.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable, Sequence

from kvplane.common import metrics
from kvplane.common.deadline import Deadline
from kvplane.common.errors import InvalidArgument, KVPlaneError
from kvplane.transfer.batch import Batch
from kvplane.transfer.engine_route import Router
from kvplane.transfer.jobs import ItemLike, PeerJob, Span
from kvplane.transfer.memory import MemoryTable, Region
from kvplane.transfer.seam import Route, Transport
from kvplane.transfer.segments import OpenSegment
from kvplane.transfer.types import OpCode, RegionDesc, RegionKind, TransferRequest, TransferStatus

log = logging.getLogger("kvplane.transfer.engine")
Transfer = Callable[[list[TransferRequest], float], list[TransferStatus]]
_Counts = dict[tuple[OpCode, TransferStatus], int]


class _Job:
    """The items of one segment one vectored transport runs, with their indexes."""

    __slots__ = ("transport", "job", "where")

    def __init__(self, transport: Transport, job: PeerJob, where: list[int]) -> None:
        self.transport, self.job, self.where = transport, job, where


class ItemPaths:
    """READs or WRITEs given as items, for one engine.

    Args:
        router: picks the transport of a route (the engine's choice, as in batches).
        memory: the local memory table.
        segments: the engine's open segments by handle (read, never changed, here).
        transfer: the engine's ``transfer(requests, timeout)``, for what no capability serves.
    """

    def __init__(self, router: Router, memory: MemoryTable, segments: dict[int, OpenSegment],
                 transfer: Transfer) -> None:
        self.router = router
        self.memory = memory
        self.segments = segments
        self.transfer = transfer
        self.vectored = router.transports.vectored
        self.one_item = router.transports.one_item
        self.mapped_one = router.transports.mapped_one

    def one(self, op: OpCode, item: ItemLike, deadline: Deadline) -> TransferStatus:
        """One item: the transport's one-item path when it has one, else as :meth:`many`."""
        handle, local, remote, length, gen = item
        seg = self.segments.get(handle)
        if seg is not None and length > 0:
            try:
                route = Route(seg.desc, seg.region(remote, length), seg.same_host)
                name = self.router.pick(None, route).name
                fast = self.one_item.get(name)
                near = self.mapped_one.get(name) if fast is None else None
                view = self.memory.view(local, length) if fast or near else None
            except KVPlaneError:
                fast = near = view = None
            st: TransferStatus | None = None
            if fast is not None and view is not None:
                go = fast.read_one if op == OpCode.READ else fast.write_one
                st = go(seg.peer, view, remote, gen, deadline)
            elif near is not None and view is not None:  # None: moved nothing, run as a batch
                st = near.copy_one(op, route, view, remote, gen, deadline)
            if st is not None:
                count({(op, st): 1}, {op: length if st == TransferStatus.COMPLETED else 0})
                return st
        return self.many(op, [item], deadline)[0]

    def routed(self, op: OpCode, local: int, handle: int, remote: int, length: int,
               transport: str | None, wait: float) -> TransferStatus:
        """``TransferEngine.transfer_one``: by the router's cached route (``Router.one``)
        where it takes the request, else through ``transfer``; counted as ``transfer``
        counts it."""
        out = self.router.one(op, local, handle, remote, length, transport,
                              time.monotonic() + wait)
        if out is None:
            return self.transfer([TransferRequest(op, local, handle, remote, length, transport)],
                                 wait)[0]
        status = out[0]
        count_one(op, status, length)
        if status != TransferStatus.COMPLETED:
            log.debug("transfer to segment %d %s: %s", handle, status.name, out[1])
        return status

    def many(self, op: OpCode, items: Sequence[ItemLike], deadline: Deadline
             ) -> list[TransferStatus]:
        """Every item's status, in order; nothing raises for one item."""
        out: list[TransferStatus] = [TransferStatus.FAILED] * len(items)
        jobs: list[_Job] = []
        rest: list[int] = []
        views = _Views(self.memory)
        for h, idx in _by_handle(items).items():
            seg = self.segments.get(h)
            if seg is None or not self.vectored:
                rest += idx  # transfer() reports it with its own status and counters
                continue
            group = [items[i] for i in idx]
            whole = self._whole_job(seg, group)
            if whole is not None:  # every item in one local and one remote region
                jobs.append(_Job(whole[0], whole[1], idx))
                continue
            got = self._item_job(seg, group, views)
            if got is not None:
                jobs.append(_Job(got[0], got[1], [idx[k] for k in got[2]]))
                chosen = set(got[2])
                rest += [i for k, i in enumerate(idx) if k not in chosen]
            else:
                rest += idx
        if jobs:
            self._run_jobs(op, jobs, deadline, out)
        if rest:
            self._rest(op, items, rest, deadline, out)
        return out

    def _run_jobs(self, op: OpCode, jobs: list[_Job], deadline: Deadline,
                  out: list[TransferStatus]) -> None:
        """Run the jobs, one call per vectored transport, and record their outcomes."""
        by_t: dict[str, list[PeerJob]] = {}
        for j in jobs:
            by_t.setdefault(j.transport.name, []).append(j.job)
        for name, peer_jobs in by_t.items():
            vec = self.vectored[name]
            (vec.read_scatter if op == OpCode.READ else vec.write_gather)(peer_jobs, deadline)
        done: _Counts = {}
        moved = 0
        ok = TransferStatus.COMPLETED
        for j in jobs:
            status, where = j.job.status, j.where
            if status.count(ok) == len(status):  # the usual case: no per-entry work
                for i in where:
                    out[i] = ok
                done[(op, ok)] = done.get((op, ok), 0) + len(where)
                moved += sum(j.job.lengths)
                continue
            for i, st, n in zip(where, status, j.job.lengths):
                out[i] = st = st or TransferStatus.FAILED
                done[(op, st)] = done.get((op, st), 0) + 1
                moved += n if st == ok else 0
        count(done, {op: moved})

    def _rest(self, op: OpCode, items: Sequence[ItemLike], rest: list[int], deadline: Deadline,
              out: list[TransferStatus]) -> None:
        """The items no capability served, through ``transfer`` (its statuses and counters)."""
        reqs = []
        for i in rest:
            h, local, remote, n, gen = items[i]
            reqs.append(TransferRequest(op, local, h, remote, n, gen=gen))
        for i, st in zip(rest, self.transfer(reqs, max(deadline.remaining(), 1e-3))):
            out[i] = st

    def _vectored(self, seg: OpenSegment, region: RegionDesc) -> Transport | None:
        """The engine's transport for ``region`` of ``seg`` when it is vectored, else None."""
        if region.kind == RegionKind.DEVICE:  # the peer stages it: READ/WRITE frames only
            return None
        t = self.router.pick(None, Route(seg.desc, region, seg.same_host))
        return t if t.name in self.vectored else None

    def _item_job(self, seg: OpenSegment, items: list[ItemLike], views: _Views
                  ) -> tuple[Transport, PeerJob, list[int]] | None:
        """The job of those ``items`` (all for ``seg``) that one vectored transport serves,
        item by item, and their positions in ``items`` (the others go through ``transfer``);
        None when it serves none."""
        job = PeerJob(seg.peer, [], [], [], [])
        local_views: list[memoryview] = []
        job.views = local_views
        taken: list[int] = []
        want: Transport | None = None  # the transport of the first item it serves
        region: RegionDesc | None = None  # the peer's region of the previous item it serves
        for k, (_, addr, remote, n, gen) in enumerate(items):
            try:
                if n <= 0:
                    raise InvalidArgument(f"length must be > 0, got {n}")
                if region is None or not (region.addr <= remote
                                          and remote + n <= region.addr + region.length):
                    region = None
                    found = seg.region(remote, n)
                    t = self._vectored(seg, found)
                    if t is None or (want is not None and t is not want):
                        continue
                    want, region = t, found
                view = views.at(addr, n)
            except KVPlaneError:
                continue
            local_views.append(view)
            job.remote.append(remote)
            job.lengths.append(n)
            job.gens.append(gen)
            taken.append(k)
        return (want, job, taken) if want is not None and taken else None

    def _whole_job(self, seg: OpenSegment, items: list[ItemLike]
                   ) -> tuple[Transport, PeerJob] | None:
        """The job of ``items`` (all for ``seg``) built a list at a time, when every local
        range lies in one registered memory region, every remote range in one region the
        peer published, and a vectored transport serves that region; else None."""
        locs = [it[1] for it in items]
        rems = [it[2] for it in items]
        lens = [it[3] for it in items]
        if min(lens) <= 0:
            return None
        lo, hi = min(locs), max(map(operator.add, locs, lens))
        rlo, rhi = min(rems), max(map(operator.add, rems, lens))
        try:
            local = self.memory.find(lo, hi - lo)
            remote = seg.region(rlo, rhi - rlo)
            t = self._vectored(seg, remote) if local.view is not None else None
        except KVPlaneError:
            return None
        if t is None or local.view is None:
            return None
        base = local.addr
        return t, PeerJob(seg.peer, rems, lens, [it[4] for it in items],
                          Span(local.view, [a - base for a in locs], lens))


def _by_handle(items: Sequence[ItemLike]) -> dict[int, list[int]]:
    """The indexes of ``items`` per segment handle (their first field), in order."""
    handles = [it[0] for it in items]
    if items and handles.count(handles[0]) == len(handles):  # one peer (the usual case)
        return {handles[0]: list(range(len(items)))}
    out: dict[int, list[int]] = {}
    for i, h in enumerate(handles):
        out.setdefault(h, []).append(i)
    return out


class _Views:
    """Local views for many requests: the region of the previous one is tried first."""

    __slots__ = ("memory", "region")

    def __init__(self, memory: MemoryTable) -> None:
        self.memory = memory
        self.region: Region | None = None

    def at(self, addr: int, n: int) -> memoryview:
        r = self.region
        if r is None or not (r.addr <= addr and addr + n <= r.end) or r.view is None:
            r = self.region = self.memory.find(addr, n)
            if r.view is None:
                raise InvalidArgument(f"{addr:#x} is in a {r.kind} region; it has no memory view")
        off = addr - r.addr
        return r.view[off:off + n]


_REQ_COUNTERS = {(op, st): metrics.TRANSFER_REQUESTS.labels(op.name.lower(), st.name.lower())
                 for op in OpCode for st in TransferStatus}
_BYTE_COUNTERS = {op: metrics.TRANSFER_BYTES.labels(op.name.lower(), "any") for op in OpCode}


def count_done(batch: Batch) -> None:
    """Count a finished batch's requests by kind and its bytes by op."""
    done: _Counts = {}
    moved: dict[OpCode, int] = {}
    for t in batch.tasks:  # one counter update per kind, not per request
        key = (t.req.op, t.status)
        done[key] = done.get(key, 0) + 1
        if t.transferred:
            moved[t.req.op] = moved.get(t.req.op, 0) + t.transferred
    count(done, moved)


def count_one(op: OpCode, status: TransferStatus, length: int) -> None:
    """Count one finished request (its bytes when it completed)."""
    _REQ_COUNTERS[(op, status)].inc()
    if status == TransferStatus.COMPLETED:
        _BYTE_COUNTERS[op].inc(length)


def count(done: _Counts, moved: dict[OpCode, int]) -> None:
    """Bump the request counters by kind and the byte counters by op (one update each)."""
    for key, n in done.items():
        _REQ_COUNTERS[key].inc(n)
    for op, n in moved.items():
        if n:
            _BYTE_COUNTERS[op].inc(n)
