"""The SSD tier, master side: which objects have disk copies, offload, demotion, promotion.

Pure bookkeeping on the master's ``ObjectTable`` (no I/O, no clock), like ``repair.py``; a
service of the table (``table.py``): it must not import the state, an RPC module or the
server. A segment whose owner runs an SSD tier mounts with ``disk_size > 0``; the master then:

* **offloads**: picks objects with a memory replica on that segment and no disk copy, and
  hands them to the owner as ``OffloadTask`` s (``disk_sync``). With write-through, every
  committed object is picked; otherwise (offload on eviction, the default) the least recently
  used ones once the segment's memory is above ``offload_watermark``, so that eviction finds
  them already on disk. The owner copies ``[header][value]`` from its own memory to a file,
  checks the checksum, and reports; only then is the disk copy part of the object.
* **demotes** on eviction: an object that has a disk copy loses its memory replicas and stays
  readable from disk; one whose offload is still pending is skipped (a put that found no room
  is told to retry, ``retry_after``); one whose offload failed, or that sits on a segment with
  no disk, is evicted as before.
* **promotes** on a read of a disk-only object: the owner asks (``promote_start``) for an
  allocation in its own segment, reads the file into it, verifies it and reports
  (``promote_end``); the object then has a memory replica again. A promotion never takes the
  segment past the eviction watermark (after evicting what it may): promoted copies are leased
  by their readers, so memory full of them would lock puts out; a refused one is served from
  disk. A promotion not reported in time is abandoned and its space fenced like an unfinished
  put's.
* **re-adopts** disk copies after a restart (``adopt``): a node re-registers the files it holds;
  a known object of the same version gains the copy, an unknown key becomes a disk-only object,
  another version is decided by the adoption's epoch order (``adopt.EpochOrder``). A version
  this master issued itself comes back only if the master still holds it, or lost it with the
  node (``orphans``): one removed or replaced while the node was away must not come back.
* **forgets**: a dropped object's disk copies are deleted by their owners (``disk_sync``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvplane.common.errors import KVPlaneError
from kvplane.store import inventory
from kvplane.store.errors import NoAvailableHandle, ObjectNotFound
from kvplane.store.master.adopt import EpochOrder
from kvplane.store.master.columns import NONE
from kvplane.store.master.eviction import Verdict
from kvplane.store.master.rows import Row
from kvplane.store.master.table import Obj, ObjectTable, Segment
from kvplane.store.tier_types import DiskReplica, OffloadTask, PromoteTask, ticket_of
from kvplane.transfer.fence import epoch_of

OFFLOAD_TIMEOUT = 30.0  # seconds an offload may take before the object is evictable again
PROMOTE_TIMEOUT = 10.0  # seconds a promotion may take before it is abandoned
TASKS_PER_SYNC = 64
PLAN_SCAN = 65536  # objects one offload planning pass looks at
ORPHANS = 1 << 20  # objects lost with unmounted nodes that are remembered (oldest go first)
BUSY = 1  # promote_start: the object is being promoted (retry), or is in memory already


@dataclass
class _Offload:
    segment: str
    task: OffloadTask
    deadline: float
    delivered: bool = False


@dataclass
class _Promotion:
    segment: str
    offset: int
    gen: int
    version: int
    deadline: float
    nbytes: int  # of the allocation (header and value)


class DiskTier:
    """Disk copies of objects, and the offload and promotion tasks in flight."""

    def __init__(self, table: ObjectTable, order: EpochOrder) -> None:
        self._st = table
        self._order = order  # adoption's age order of past masters' epochs
        self.offloads: dict[str, _Offload] = {}
        self.promotions: dict[str, _Promotion] = {}
        self.failed: set[str] = set()  # offload failed: evicted like an object without disk
        self.unsaved: set[str] = set()  # write-through: committed, not on disk yet
        self._forgets: dict[str, dict[str, int]] = {}  # segment -> key -> version to delete
        # objects that left with an unmounted node (its TTL ran out): they may come back with it
        self.orphans: OrderedDict[str, int] = OrderedDict()
        self.offloaded = 0
        self.demoted = 0
        self.promoted = 0
        self.refused = 0  # promotions refused: memory at the watermark (served from disk)

    # -- what the state calls ----------------------------------------------------------------
    def disk_segment(self, name: str) -> bool:
        seg = self._st.segments.get(name)
        return seg is not None and seg.info.disk_size > 0

    def stored(self, key: str, obj: Row) -> None:
        """``key`` was committed: a write-through segment copies it to disk at once."""
        st = self._st
        if obj.more_replicas():
            through = any(st.segments[s].info.write_through for s, _, _ in obj.replicas)
        else:  # the common case: one replica at most, read from the columns
            seg = st.seg_by_sid[obj.first_sid()] if obj.first_sid() >= 0 else None
            through = seg is not None and seg.info.write_through
        if through:
            self.unsaved.add(key)

    def verdict(self, key: str, obj: Row, now: float) -> Verdict:
        """How eviction treats ``obj``: DEMOTE (drop memory, keep disk), KEEP (its disk copy
        is being made, or will be: an offload is queued now if none is), or DROP (no disk
        tier for it)."""
        if obj.disk:
            return Verdict.DEMOTE
        if key in self.failed:
            return Verdict.DROP
        if not any(self.disk_segment(s) for s, _, _ in obj.replicas):
            return Verdict.DROP
        p = self.offloads.get(key)
        if p is None:
            self._queue(key, obj, now)
            return Verdict.KEEP if key in self.offloads else Verdict.DROP
        return Verdict.KEEP

    def dropped(self, key: str, obj: Row, now: float) -> None:
        """``obj`` left the store: its disk copies are deleted, its tasks forgotten."""
        for seg, _path in obj.disk.items():
            self._forgets.setdefault(seg, {})[key] = obj.version
        obj.disk = {}
        self.offloads.pop(key, None)
        self.failed.discard(key)
        self.unsaved.discard(key)
        p = self.promotions.pop(key, None)
        if p is not None:
            self._abandon(key, p, now)

    def drop_segment(self, name: str) -> list[str]:
        """``name`` was unmounted: its disk copies go (the node re-adopts them when it comes
        back). Returns keys left with no replica at all (the caller drops them)."""
        gone = []
        cols = self._st.cols
        for row in [r for r, copies in cols.disk.items() if name in copies]:  # (rows with copies)
            obj = Row(cols, row)
            obj.set_disk(name, None)
            if not obj.disk and not any(s != name for s, _, _ in obj.replicas):
                gone.append(obj.key)
                self.orphans[obj.key] = obj.version  # lost with the node, not removed
                if len(self.orphans) > ORPHANS:
                    self.orphans.popitem(last=False)
        for key in [k for k, p in self.offloads.items() if p.segment == name]:
            del self.offloads[key]
        for key in [k for k, p in self.promotions.items() if p.segment == name]:
            del self.promotions[key]
        self._forgets.pop(name, None)
        return gone

    def demote(self, key: str, obj: Row, now: float) -> int:
        """Drop the memory replicas of an object that has a disk copy; returns bytes freed."""
        freed = (obj.hdr + obj.size) * len(obj.replicas)
        self._st.drop_replicas(obj, {s for s, _, _ in obj.replicas}, now)
        self._st.cols.touch(obj.row)  # out of the way of the memory LRU's oldest end
        self.demoted += 1
        return freed

    def pending_bytes(self) -> int:
        """Bytes whose offload is under way (eviction will be able to free them)."""
        objs = self._st.objects
        return sum(objs[k].hdr + objs[k].size for k in self.offloads if k in objs)

    # -- offload -------------------------------------------------------------------------------
    def plan(self, now: float) -> int:
        """Queue offloads: write-through objects, and the LRU tail of segments above the
        offload watermark. Returns tasks queued."""
        st = self._st
        made = 0
        for key in list(self.unsaved):
            obj = st.objects.get(key)
            self.unsaved.discard(key)
            if obj is not None and obj.complete and not obj.disk and key not in self.offloads:
                made += self._queue(key, obj, now)
        want: dict[str, int] = {}
        for name, seg in st.segments.items():
            if seg.info.disk_size <= 0:
                continue
            cap = seg.alloc.capacity
            excess = seg.alloc.used - (st.config.offload_watermark - st.config.evict_ratio) * cap
            if seg.alloc.used > st.config.offload_watermark * cap and excess > 0:
                want[name] = int(excess)
        for p in self.offloads.values():
            if p.segment in want:
                want[p.segment] -= p.task.hdr + p.task.size
        # oldest first; replicas already on disk count too (eviction can drop them at once).
        # At most PLAN_SCAN objects a pass: eviction queues what it meets itself (``verdict``)
        c = st.cols
        wanted = {c.sid_of[name] for name in want}
        for n, row in enumerate(c.rows()):
            if n >= PLAN_SCAN or not any(v > 0 for v in want.values()):
                break
            if c.more[row] == NONE and c.seg[row] not in wanted:
                continue  # (the common case, from the columns: no replica where room is wanted)
            obj = Row(c, row)
            key = obj.key
            if not obj.replicas or not obj.complete or key in self.offloads or key in self.failed:
                continue
            over = next((s for s, _, _ in obj.replicas if want.get(s, 0) > 0), None)
            if over is None:
                continue
            if not obj.disk:
                made += self._queue(key, obj, now)
            want[over] -= obj.hdr + obj.size
        return made

    def _queue(self, key: str, obj: Row, now: float) -> int:
        st = self._st
        for seg, off, gen in obj.replicas:
            s = st.segments.get(seg)
            if s is None or s.info.disk_size <= 0 or s.suspect_since is not None:
                continue
            task = OffloadTask(key, obj.version, s.info.base + off, obj.hdr, obj.size,
                               obj.checksum, gen)
            self.offloads[key] = _Offload(seg, task, now + OFFLOAD_TIMEOUT)
            return 1
        return 0

    def take(self, segments: set[str]) -> list[OffloadTask]:
        out = []
        for p in self.offloads.values():
            if not p.delivered and p.segment in segments:
                p.delivered = True
                out.append(p.task)
                if len(out) >= TASKS_PER_SYNC:
                    break
        return out

    def offload_done(self, segment: str, key: str, version: int, ok: bool, path: str) -> bool:
        """The owner of ``segment`` reported the offload of ``key``; True when the disk copy
        joined the object (False: the owner deletes its file)."""
        p = self.offloads.get(key)
        if p is not None and p.segment == segment and p.task.version == version:
            del self.offloads[key]
        obj = self._st.objects.get(key)
        if not ok:
            if obj is not None and obj.version == version:
                self.failed.add(key)
            return False
        if obj is None or not obj.complete or obj.version != version or \
                segment not in self._st.segments:
            return False
        obj.set_disk(segment, path)
        self.offloaded += 1
        return True

    def forgets_for(self, segments: set[str]) -> list[tuple[str, int]]:
        out: list[tuple[str, int]] = []
        for name in segments:
            out.extend(self._forgets.pop(name, {}).items())
        return out

    def lost(self, segment: str, key: str, version: int, now: float) -> bool:
        """The owner of ``segment`` no longer has this disk copy (evicted by its quota, or
        found corrupt). Returns True when the object went with it."""
        obj = self._st.objects.get(key)
        if obj is None or obj.version != version or not obj.set_disk(segment, None):
            return False
        if not obj.disk and not obj.replicas:
            self._st.drop_object(key, obj, now)
            return True
        return False

    def expire(self, now: float) -> None:
        for key in [k for k, p in self.offloads.items() if p.deadline <= now]:
            del self.offloads[key]
            self.failed.add(key)  # not copied in time: evictable like any object
        for key in [k for k, p in self.promotions.items() if p.deadline <= now]:
            self._abandon(key, self.promotions.pop(key), now)

    # -- promotion ------------------------------------------------------------------------------
    def promote_start(self, segment: str, key: str, version: int, now: float) -> PromoteTask:
        """Allocate a memory replica for a disk copy the owner of ``segment`` will read in."""
        st = self._st
        obj = st.objects.get(key)
        if obj is None or obj.version != version or segment not in obj.disk:
            return PromoteTask(ObjectNotFound.code)
        if obj.replicas or key in self.promotions:
            return PromoteTask(BUSY)
        seg = st.segments[segment]
        need = obj.hdr + obj.size
        over = self._over(seg, need)
        if over > 0:
            st.evict(now, need=over)
        off = seg.alloc.allocate(need) if self._over(seg, need) <= 0 else None
        if off is None:  # the reader is served from disk (inline) instead
            self.refused += 1
            return PromoteTask(NoAvailableHandle.code)
        gen = st.new_generation()
        self.promotions[key] = _Promotion(segment, off, gen, version, now + PROMOTE_TIMEOUT, need)
        return PromoteTask(0, seg.info.base + off, gen, obj.hdr, obj.size)

    def _over(self, seg: Segment, need: int) -> int:
        """Bytes by which promoting ``need`` bytes would take ``seg`` past the eviction
        watermark. Promoted copies are leased by their readers, and eviction skips leased
        objects: promotion never takes a segment past the watermark, so that much of memory
        always stays for puts (issue 28)."""
        cap = seg.alloc.capacity
        return int(seg.alloc.used + need - self._st.config.high_watermark * cap)

    def promote_end(self, key: str, gen: int, ok: bool, now: float) -> bool:
        """The owner read the disk copy into the allocation of ``gen`` (``ok``) or failed."""
        p = self.promotions.get(key)
        if p is None or p.gen != gen:
            return False
        del self.promotions[key]
        st = self._st
        obj = st.objects.get(key)
        seg = st.segments.get(p.segment)
        if seg is None:
            return False
        if ok and obj is not None and obj.version == p.version and obj.complete:
            obj.replicas += ((p.segment, p.offset, gen),)
            st.cols.touch(obj.row)
            self.promoted += 1
            return True
        st.adoption.forget(seg, p.offset, gen)
        seg.alloc.free(p.offset, p.nbytes)  # the owner reported: its copy is over
        return False

    def _abandon(self, key: str, p: _Promotion, now: float) -> None:
        st = self._st
        seg = st.segments.get(p.segment)
        if seg is not None:
            st.adoption.forget(seg, p.offset, p.gen)
            st.graveyard.hold(p.segment, p.offset, p.nbytes, now, p.gen)  # fenced before reuse

    # -- reads and re-adoption ------------------------------------------------------------------
    def disk_replicas(self, key: str, obj: Row) -> list[DiskReplica]:
        st = self._st
        return [DiskReplica(s, st.segments[s].info.disk_endpoint, path, obj.size, key,
                            ticket_of(st.secret, key, obj.version, s))
                for s, path in obj.disk.items() if s in st.segments]

    def adopt(self, seg: Segment, records: list[inventory.Record], paths: list[str],
              history: list[int], now: float) -> list[int]:
        """Re-register the disk copies ``seg``'s owner holds; per record 1 (taken) or 0 (the
        owner deletes that file)."""
        self._order.add(history)
        out = []
        for rec, path in zip(records, paths, strict=True):
            out.append(1 if self._adopt_one(seg, rec, path, now) else 0)
        return out

    def _adopt_one(self, seg: Segment, rec: inventory.Record, path: str, now: float) -> bool:
        st = self._st
        try:
            st.check_key(rec.key)
        except KVPlaneError:
            return False
        name = seg.info.name
        obj = st.objects.get(rec.key)
        if obj is not None and obj.version == rec.version and obj.complete:
            obj.set_disk(name, path)
            return True
        if epoch_of(rec.version) == st.epoch and self.orphans.get(rec.key) != rec.version:
            return False  # this master put it and removed or replaced it since: not back
        if obj is not None and (not obj.complete or not self._order.newer(rec.version, obj.version)):
            return False
        if obj is not None:
            st.drop_object(rec.key, obj, now)
        st.insert_complete(rec.key, Obj(  # no memory replica until a read promotes it
            rec.size, (), True, 0.0, hard_pin=bool(rec.flags & inventory.FLAG_HARD_PIN),
            version=rec.version, checksum=rec.checksum, want=rec.want, hdr=rec.hdr,
            flags=rec.flags, disk={name: path}))
        self.orphans.pop(rec.key, None)
        return True
