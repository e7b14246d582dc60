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

from collections.abc import Iterator, MutableSet
from dataclasses import dataclass, field

from kvplane.store import inventory
from kvplane.store.master.columns import COMPLETE, SHORT, SHORT_LISTED, Columns
from kvplane.store.master.table import ObjectTable
from kvplane.store.types import RepairTask

SCAN = 4096  # short objects looked at per planning pass
TASK_COST = 16  # a task made costs about as much as looking at this many short objects
CHUNK = 1 << 15  # rows a planning pass scans for the SHORT bit at a time (a vectorised scan) ...
CHUNK_COST = 32  # ... which counts as this many objects of a step's budget
COUNT = SHORT_LISTED  # up to this many short objects are counted exactly (every tick)


class ShortRows(MutableSet[str]):
    """The objects that may hold fewer replicas than asked for, as a set of keys: the SHORT
    bit of their rows (``Columns.mark_short``), so that millions of them (an unmount) cost no
    Python object each and nothing for the cyclic collector to walk."""

    def __init__(self, cols: Columns) -> None:
        self._c = cols

    def __contains__(self, key: object) -> bool:
        row = self._c.index.find(key) if isinstance(key, str) else -1
        return row >= 0 and bool(self._c.flags[row] & SHORT)

    def __iter__(self) -> Iterator[str]:
        c = self._c
        rows = sorted(c.short_rows) if c.short_rows is not None else c.short_in(0, c.scan_end())
        return iter([c.key(r) for r in rows])

    def __len__(self) -> int:
        return self._c.short

    def add(self, key: str) -> None:
        row = self._c.index.find(key)
        if row >= 0:
            self._c.mark_short(row)

    def discard(self, key: str) -> None:
        row = self._c.index.find(key)
        if row >= 0:
            self._c.unmark_short(row)


@dataclass
class PlanPass:
    """A repair planning pass in progress (``Repairs.plan_step``): up to ``SCAN`` short
    objects, from where the last pass stopped."""

    todo: list[int] = field(default_factory=list)  # rows found short, not looked at yet (last first)
    started: bool = False
    pos: int = -1  # next row to scan for the bit (-1: the listed rows were taken instead)
    scanned: int = 0  # rows scanned so far (a whole table's worth ends the pass)
    looked: int = 0
    made: int = 0


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
        # objects that may have fewer replicas than asked for (millions after an unmount)
        self.short = ShortRows(table.cols)
        self._cursor = 0  # where the next planning pass scans from (the bits only)
        self.pending: dict[str, _Pending] = {}
        self.done_count = 0
        self.surplus = 0  # completed copies dropped: the object had its replicas already

    def under_replicated(self) -> int:
        """Complete objects holding fewer replicas than asked for, now: exact while at most
        ``COUNT`` objects are marked short (listed), else an upper bound (every object marked
        short; a planning pass unmarks those that are not)."""
        c = self._st.cols
        if c.short_rows is None:
            return c.short
        return sum(1 for r in c.short_rows if self._short(r))

    def _short(self, row: int) -> bool:
        c = self._st.cols
        if not c.flags[row] & COMPLETE:
            return False
        want = c.want[row]
        if c.seg[row] >= 0 and c.more[row] < 0:  # one replica (the common case)
            return want > 1 and bool(c.live[c.seg[row]])
        return 0 < len(c.replicas(row)) < want

    def settled(self, now: float) -> bool:
        """Whether replica counts can be trusted: no recovery under way, no segment still
        re-registering what it holds."""
        st = self._st
        return not st.recovering(now) and not any(s.adopting for s in st.segments.values())

    def plan(self, now: float, scan: int = SCAN) -> int:
        """Allocate targets for short objects (no eviction), looking at up to ``scan`` of them;
        returns tasks created. Nothing while replicas may still be coming back (``settled``)."""
        job = PlanPass()
        while not self._plan(job, now, 1 << 62, scan, 0):
            pass
        return job.made

    def plan_step(self, job: PlanPass, now: float, budget: int) -> bool:
        """One step of a planning pass (``PlanPass()`` starts one): look at short objects
        until ``budget`` is spent (one unit an object, ``TASK_COST`` a task made,
        ``CHUNK_COST`` a scan of ``CHUNK`` rows for the bit); True when the pass is over
        (``SCAN`` objects looked at, the whole table scanned, or nothing to plan)."""
        return self._plan(job, now, budget, SCAN, TASK_COST)

    def _plan(self, job: PlanPass, now: float, budget: int, scan: int, task_cost: int) -> bool:
        st = self._st
        c = st.cols
        if not c.short or not self.settled(now):
            return True
        if not job.started:
            job.started = True
            if c.short_rows is not None:
                job.todo = sorted(c.short_rows, reverse=True)
            else:
                job.pos = self._cursor
        while budget > 0 and job.looked < scan:
            if not job.todo:
                end = c.scan_end()
                if job.pos < 0 or job.scanned >= end:
                    return True
                if job.pos >= end:
                    job.pos = 0
                stop = min(job.pos + CHUNK, end)
                job.todo = c.short_in(job.pos, stop)[::-1]
                job.scanned += stop - job.pos
                job.pos = self._cursor = stop
                budget -= CHUNK_COST
                continue
            row = job.todo.pop()
            budget -= 1
            if not c.flags[row] & SHORT:  # unmarked meanwhile (repaired, dropped)
                continue
            job.looked += 1
            if not self._short(row):
                c.unmark_short(row)
                continue
            if self._plan_one(c.key(row), now):
                job.made += 1
                budget -= task_cost
        if job.looked < scan:
            return False
        if job.pos >= 0 and job.todo:  # the next pass goes on with what this one found last
            self._cursor = job.todo[-1]
        return True

    def _plan_one(self, key: str, now: float) -> bool:
        """A repair task for the short object ``key``; False when none was made."""
        st = self._st
        if key in self.pending:
            return False
        obj = st.objects[key]
        target = self._target(obj.hdr + obj.size, {s for s, _, _ in obj.replicas})
        if target is None:
            return False
        name, off = target
        seg = st.segments[name]
        gen = st.new_generation()
        sources = sorted(obj.replicas, key=lambda r: st.segments[r[0]].suspect_since is not None)
        header = inventory.pack(st.secret, key, gen, obj.version, obj.size, obj.checksum,
                                obj.want, obj.flags) if obj.hdr else b""
        task = RepairTask(key, obj.version, gen, seg.info.base + off + obj.hdr, obj.size,
                          obj.checksum, obj.replicas_of(st.segments, sources), header)
        self.pending[key] = _Pending(name, off, task, now + st.config.repair_timeout)
        return True

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
