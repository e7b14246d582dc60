"""Adoption: a master takes over the objects that segments already hold (issue 10).

Pure bookkeeping on the master's ``ObjectTable`` (no I/O, no clock), like ``repair.py``; a
service of the table (``table.py``): it must not import the state, an RPC module or the server. A segment that
mounts with a master that does not know it (a new leader, a restarted master, a remount after
its TTL ran out) scans its memory (``kvplane.store.inventory``) and re-registers every intact
record; ``Adoption.adopt`` takes each record's exact space in that segment's allocator, gives it a
generation of this master's epoch, and joins it to its object:

* a key not known yet becomes a complete object (leases and soft pins are soft state and start
  empty; a hard pin is kept, it is in the record);
* the same version joins as one more replica, up to the replicas the object asked for;
* a different version: the newer one wins, by ``EpochOrder``; objects this master wrote itself
  are always the newest;
* a record whose generation is of this master's own epoch (a segment that comes back to the
  same master after its TTL ran out) may only join the same version of a known object: this
  master never lost its state, so an object it does not know any more was removed or replaced
  while the segment was away, and must not come back;

and everything not taken is refused (the segment then invalidates that header). Until a segment
sends its last batch it takes no new placements, so nothing new is allocated over space it has
not re-registered yet.

``Adoption`` also keeps the *forget* queue: when the master frees an allocation that may hold a
record, the owning segment is told (with its heartbeat reply) to clear that header, so a removed
object does not come back after the next failover. Forgets are acknowledged like fences.
"""

from __future__ import annotations

import graphlib
from collections.abc import Iterable
from itertools import islice

from kvplane.common.errors import KVPlaneError
from kvplane.store.inventory import FLAG_HARD_PIN, Record
from kvplane.store.master.columns import ShardedIntMap
from kvplane.store.master.rows import Row
from kvplane.store.master.table import Obj, ObjectTable, Segment
from kvplane.transfer.fence import COUNTER_MASK, epoch_of

FORGETS_PER_PING = 4096


class EpochOrder:
    """Orders the epochs of past masters by the mount histories segments report.

    Each segment lists the epochs it mounted with, oldest first; they are all subsequences of
    one true sequence (one master leads at a time), so their union is a DAG whose topological
    order is the age order. This master's own epoch is the newest.
    """

    def __init__(self, current: int) -> None:
        self.current = current
        self._edges: dict[int, set[int]] = {}
        self._rank: dict[int, int] | None = {}

    def add(self, history: Iterable[int]) -> None:
        prev = None
        for epoch in history:
            if epoch == self.current:
                continue
            if epoch not in self._edges:
                self._edges[epoch] = set()
                self._rank = None
            if prev is not None and prev not in self._edges[epoch]:
                self._edges[epoch].add(prev)
                self._rank = None
            prev = epoch

    def rank(self, epoch: int) -> int:
        if epoch == self.current:
            return 1 << 62
        if self._rank is None:
            try:
                order = list(graphlib.TopologicalSorter(self._edges).static_order())
            except graphlib.CycleError:  # two masters drew the same random epoch: give up order
                order = sorted(self._edges)
            self._rank = {e: i for i, e in enumerate(order)}
        return self._rank.get(epoch, -1)

    def newer(self, a: int, b: int) -> bool:
        """True when generation/version ``a`` was issued after ``b``."""
        return (self.rank(epoch_of(a)), a & COUNTER_MASK) > (self.rank(epoch_of(b)), b & COUNTER_MASK)


class Adoption:
    """Re-registration of segments' records, and the forget queue."""

    def __init__(self, table: ObjectTable) -> None:
        self._st = table
        self.order = EpochOrder(table.epoch)
        # segment -> gen -> header address (a mass eviction queues millions)
        self._forgets: dict[str, ShardedIntMap] = {}
        self.adopted = 0
        self.refused = 0

    # -- forgets -----------------------------------------------------------------------------
    def forget(self, seg: Segment, off: int, gen: int) -> None:
        """The allocation at ``off`` (generation ``gen``) was freed: its header must go."""
        if gen:
            pending = self._forgets.get(seg.info.name)
            if pending is None:
                pending = self._forgets[seg.info.name] = ShardedIntMap()
            pending[gen] = seg.info.base + off

    def forgets_for(self, names: Iterable[str]) -> list[tuple[int, int]]:
        """(generation, header address) pairs the owner of ``names`` must clear."""
        out: list[tuple[int, int]] = []
        for name in sorted(names):
            pending = self._forgets.get(name)
            if pending:
                out.extend(islice(pending.items(), FORGETS_PER_PING - len(out)))
        return out

    def forgot(self, names: Iterable[str], gens: list[int]) -> None:
        for name in names:
            pending = self._forgets.get(name)
            if pending:
                for g in gens:
                    pending.pop(g, None)
                if not pending:
                    del self._forgets[name]

    def drop_segment(self, name: str) -> None:
        self._forgets.pop(name, None)

    def pending(self) -> int:
        return sum(len(p) for p in self._forgets.values())

    # -- adoption ----------------------------------------------------------------------------
    def adopt(self, seg: Segment, records: list[Record], history: list[int],
              now: float) -> list[int]:
        """Take over ``records`` held by ``seg``; per record its new generation, or 0 (refused:
        the segment must invalidate that header)."""
        self.order.add(history)
        out = [self._one(seg, r, now) for r in records]
        self.adopted += sum(1 for g in out if g)
        self.refused += sum(1 for g in out if not g)
        return out

    def _one(self, seg: Segment, rec: Record, now: float) -> int:
        st = self._st
        try:
            st.check_key(rec.key)
        except KVPlaneError:  # a key the master would refuse is simply not adopted
            return 0
        obj = st.objects.get(rec.key)
        if obj is not None and obj.version == rec.version:
            for name, off, gen in obj.replicas:
                if name == seg.info.name and off == rec.offset:
                    return gen  # a repeated adopt call: this record is already taken
        if epoch_of(rec.gen) == st.epoch and (obj is None or obj.version != rec.version):
            return 0  # this master issued it and has forgotten it since: removed or replaced
        if rec.want < 1 or not seg.alloc.allocate_at(rec.offset, rec.hdr + rec.size):
            return 0
        if obj is not None and not self._better(rec, obj, seg.info.name):
            seg.alloc.free(rec.offset, rec.hdr + rec.size)
            return 0
        gen = st.new_generation()
        if obj is not None and obj.complete and obj.version == rec.version:
            obj.replicas += ((seg.info.name, rec.offset, gen),)
            return gen
        if obj is not None:
            st.drop_object(rec.key, obj, now)
        st.insert_complete(rec.key, Obj(
            rec.size, ((seg.info.name, rec.offset, gen),), True, 0.0,
            hard_pin=bool(rec.flags & FLAG_HARD_PIN), version=rec.version,
            checksum=rec.checksum, want=rec.want, hdr=rec.hdr, flags=rec.flags))
        return gen

    def _better(self, rec: Record, obj: Row, segment: str) -> bool:
        """Whether ``rec`` may join or replace the known object ``obj``."""
        if not obj.complete:  # a put of this master is under way: it is newer
            return False
        if obj.version == rec.version:
            return len(obj.replicas) < max(rec.want, obj.want) and \
                all(s != segment for s, _, _ in obj.replicas)
        return self.order.newer(rec.version, obj.version)
