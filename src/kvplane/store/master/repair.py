"""Re-replication: objects that lost replicas get them back, copied by the segments themselves.

Pure bookkeeping on the master's ``ObjectTable`` (no I/O, no clock); a service of the table
(``table.py``): it must not import the state, an RPC module or the server. The master holds no bytes, so a
repair is a task for the owner of the target segment: "read object K (version V, checksum C)
from one of these replicas into your memory at ADDR (allocation GEN), then report". The task
rides that client's heartbeat reply; the client reads, verifies the checksum and answers with
``repair_done``. Only then does the replica join the object. A task not answered within
``repair_timeout`` is abandoned, and its space is fenced like an unfinished put's (the copy may
still be in flight inside the target process).

The target allocation has room for the inventory header too; the task carries that header
(with the task's generation), and the target writes it only once its copy verified, so a
repaired replica is re-registered like any other after a failover (``adopt.py``).

Never more replicas than asked for (issue 28): nothing is planned while the master recovers
(``ObjectTable.recovering``: a restart or a new leadership, until every segment it expects has
re-registered or the grace ends) or while any segment is still re-registering, since the
replica an object seems to lack may be on its way back; and a copy that completes when the
object already holds its replicas (one came back by re-registration meanwhile) is dropped and
its space freed (``surplus`` counts them).
"""

from __future__ import annotations

from collections.abc import MutableSet
from dataclasses import dataclass
from itertools import islice

from kvplane.store import inventory
from kvplane.store.master.columns import ShardedSet
from kvplane.store.master.table import ObjectTable
from kvplane.store.types import RepairTask

SCAN = 4096  # short keys looked at per planning pass
TASK_COST = 16  # a task made costs about as much as looking at this many short objects
COUNT = 2048  # short keys looked at to count the under-replicated ones (every tick)


@dataclass
class _Pending:
    segment: str
    offset: int
    task: RepairTask
    deadline: float
    delivered: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of the target allocation (header and value)."""
        return self.task.size + len(self.task.header)


class Repairs:
    """Objects short of replicas and the repair tasks in flight."""

    def __init__(self, table: ObjectTable) -> None:
        self._st = table
        # keys that may have fewer replicas than asked for (millions after an unmount)
        self.short: MutableSet[str] = ShardedSet()
        self.pending: dict[str, _Pending] = {}
        self.done_count = 0
        self.surplus = 0  # completed copies dropped: the object had its replicas already

    def under_replicated(self) -> int:
        """Complete objects holding fewer replicas than asked for, now: exact while at most
        ``COUNT`` objects may be short, else an upper bound (every key that may be short;
        counting more would hold the lock too long)."""
        if len(self.short) > COUNT:
            return len(self.short)
        get = self._st.row_of
        return sum(1 for k in self.short if (o := get(k)) is not None and o.complete
                   and 0 < o.replica_count() < o.want)

    def settled(self, now: float) -> bool:
        """Whether replica counts can be trusted: no recovery under way, no segment still
        re-registering what it holds."""
        st = self._st
        return not st.recovering(now) and not any(s.adopting for s in st.segments.values())

    def plan(self, now: float, scan: int = SCAN) -> int:
        """Allocate targets for short objects (no eviction), looking at up to ``scan`` of them;
        returns tasks created. Nothing while replicas may still be coming back (``settled``)."""
        return self._plan(now, scan, 0, 0)[0]

    def plan_step(self, now: float, budget: int, skip: int) -> int:
        """One step of a planning pass in steps: go on after the first ``skip`` short objects,
        looking at objects until ``budget`` is spent (one unit an object, ``TASK_COST`` a task
        made); returns how many it looked at (0: nothing to plan)."""
        return self._plan(now, budget, skip, TASK_COST)[1]

    def _plan(self, now: float, scan: int, skip: int, task_cost: int) -> tuple[int, int]:
        st, made, spent, looked = self._st, 0, 0, 0
        if not self.short or not self.settled(now):
            return 0, 0
        for key in list(islice(self.short, skip, skip + scan)):
            if spent >= scan:
                break
            spent += 1
            looked += 1
            obj = st.row_of(key)
            if obj is None or not obj.complete or not 0 < obj.replica_count() < obj.want:
                self.short.discard(key)
                continue
            if key in self.pending:
                continue
            target = self._target(obj.hdr + obj.size, {s for s, _, _ in obj.replicas})
            if target is None:
                continue
            name, off = target
            seg = st.segments[name]
            gen = st.new_generation()
            sources = sorted(obj.replicas, key=lambda r: st.segments[r[0]].suspect_since is not None)
            header = inventory.pack(st.secret, key, gen, obj.version, obj.size, obj.checksum,
                                    obj.want, obj.flags) if obj.hdr else b""
            task = RepairTask(key, obj.version, gen, seg.info.base + off + obj.hdr, obj.size,
                              obj.checksum, obj.replicas_of(st.segments, sources), header)
            self.pending[key] = _Pending(name, off, task, now + st.config.repair_timeout)
            made += 1
            spent += task_cost
        return made, looked

    def _target(self, size: int, holders: set[str]) -> tuple[str, int] | None:
        st = self._st
        names = [n for n, s in st.segments.items() if n not in holders and s.suspect_since is None
                 and not s.adopting and s.info.client_id in st.clients
                 and s.alloc.largest_free() >= size]
        st.rng.shuffle(names)
        for name in names:
            off = st.segments[name].alloc.allocate(size)
            if off is not None:
                return name, off
        return None

    def take(self, client_id: str) -> list[RepairTask]:
        """Undelivered tasks for the segments of ``client_id`` (marked delivered)."""
        client = self._st.clients.get(client_id)
        if client is None:
            return []
        out = []
        for p in self.pending.values():
            if not p.delivered and p.segment in client.segments:
                p.delivered = True
                out.append(p.task)
                if len(out) >= self._st.config.repairs_per_ping:
                    break
        return out

    def done(self, key: str, gen: int, ok: bool, now: float) -> bool:
        """The target reported task ``gen`` for ``key``; True when the replica joined."""
        p = self.pending.get(key)
        if p is None or p.task.gen != gen:
            return False
        del self.pending[key]
        st = self._st
        obj = st.objects.get(key)
        seg = st.segments.get(p.segment)
        if seg is None:
            return False
        if ok and obj is not None and obj.complete and obj.version == p.task.version \
                and (len(obj.replicas) >= obj.want  # came back meanwhile: one too many
                     or any(s == p.segment for s, _, _ in obj.replicas)):  # or onto this segment
            self.surplus += 1
            if len(obj.replicas) >= obj.want:
                self.short.discard(key)
        elif ok and obj is not None and obj.complete and obj.version == p.task.version:
            obj.replicas += ((p.segment, p.offset, gen),)
            self.done_count += 1
            if len(obj.replicas) >= obj.want:
                self.short.discard(key)
            return True
        st.adoption.forget(seg, p.offset, gen)  # its header, if the target wrote one
        seg.alloc.free(p.offset, p.nbytes)  # the target's copy is over (it reported): nothing can land
        return False

    def expire(self, now: float) -> int:
        """Abandon tasks past their deadline; their space waits for a fence."""
        late = [k for k, p in self.pending.items() if p.deadline <= now]
        for key in late:
            self._abandon(self.pending.pop(key), now)
        return len(late)

    def forget(self, key: str, now: float) -> None:
        """``key`` was dropped: abandon its repair, if any."""
        p = self.pending.pop(key, None)
        if p is not None:
            self._abandon(p, now)
        self.short.discard(key)

    def _abandon(self, p: _Pending, now: float) -> None:
        st = self._st
        if p.segment not in st.segments:
            return
        if p.delivered:  # the target may be copying: fence before reuse
            st.adoption.forget(st.segments[p.segment], p.offset, p.task.gen)
            st.graveyard.hold(p.segment, p.offset, p.nbytes, now, p.task.gen)
        else:
            st.segments[p.segment].alloc.free(p.offset, p.nbytes)

    def drop_segment(self, name: str) -> None:
        """``name`` was unmounted: tasks targeting it go (their space went with it)."""
        for key in [k for k, p in self.pending.items() if p.segment == name]:
            del self.pending[key]
            self.short.add(key)
