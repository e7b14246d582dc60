"""Copy and move tasks (Mooncake's CreateCopyTask / CreateMoveTask / QueryTask) on the object table.

A service of the master's ``ObjectTable`` (``table.py``): it must not import the state, an RPC
module or the server. Pure bookkeeping: no I/O, no threads, no clock reads (``now`` monotonic
seconds and ``wall_ms`` come from the caller). The master holds no bytes, so a task is carried
out by a client, the *runner* (here: the client that created it), in three steps:

1. ``create``: checks the key and segments (-704 OBJECT_NOT_FOUND, -600 INVALID_PARAMS for an
   unknown segment, a move onto its own source, or a source without a replica) and queues the
   task PENDING (-1401 when ``max_pending`` are queued).
2. ``start``: allocates the targets (segments already holding a replica are skipped), takes a
   read lease on the object so neither eviction nor a plain remove can take its source away,
   and marks it PROCESSING. The runner reads a source and writes the targets.
3. ``finish``: the written targets join the object (a move then drops its source replica); a
   target that failed is freed. Then SUCCESS, or FAILED with a message.

A task left PROCESSING past ``processing_timeout`` (its runner died) fails and its targets are
freed; a task PENDING past ``pending_timeout`` fails. Finished tasks are kept for ``query`` up
to ``max_finished``, oldest dropped first (then -1400 TASK_NOT_FOUND).
"""

from __future__ import annotations

import enum
import itertools
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field

from kvplane.store import inventory
from kvplane.store.errors import InvalidParams, ObjectNotFound
from kvplane.store.master.rows import Rep, Row
from kvplane.store.master.table import ObjectTable
from kvplane.store.replica_types import TaskId, TaskInfo, TaskWork

TASK_NOT_FOUND = -1400
TASK_PENDING_LIMIT_EXCEEDED = -1401


class TaskStatus(str, enum.Enum):
    """A task's state (``TaskInfo.status`` on the wire carries its value)."""

    PENDING = "PENDING"
    PROCESSING = "PROCESSING"
    SUCCESS = "SUCCESS"
    FAILED = "FAILED"


PENDING, PROCESSING = TaskStatus.PENDING, TaskStatus.PROCESSING
FINISHED = (TaskStatus.SUCCESS, TaskStatus.FAILED)


@dataclass
class Task:
    id: TaskId
    kind: str
    key: str
    targets: list[str]
    source: str
    client_id: str
    created_ms: int
    updated_ms: int
    since: float
    status: TaskStatus = PENDING
    message: str = ""
    size: int = 0
    allocated: list[Rep] = field(default_factory=list)  # target allocations


class Tasks:
    """The task table of one master. The caller holds the state lock around every call."""

    def __init__(self, table: ObjectTable, max_pending: int = 10000,
                 max_finished: int = 10000, pending_timeout: float = 300.0,
                 processing_timeout: float = 300.0) -> None:
        self._st = table
        self.max_pending, self.max_finished = max_pending, max_finished
        self.pending_timeout, self.processing_timeout = pending_timeout, processing_timeout
        self.tasks: OrderedDict[tuple[int, int], Task] = OrderedDict()
        self._seq = itertools.count(1)
        self._salt = secrets.randbits(63)

    def _new_id(self) -> TaskId:
        return TaskId(self._salt, next(self._seq))

    # -- create -------------------------------------------------------------------------------
    def create(self, kind: str, key: str, targets: list[str], source: str, client_id: str,
               now: float, wall_ms: int) -> tuple[int, TaskId]:
        """Queue a task; (0, id) or (negative code, TaskId(0, 0))."""
        code = self._check(kind, key, targets, source)
        if code:
            return code, TaskId(0, 0)
        if sum(1 for t in self.tasks.values() if t.status is PENDING) >= self.max_pending:
            return TASK_PENDING_LIMIT_EXCEEDED, TaskId(0, 0)
        tid = self._new_id()
        self.tasks[(tid.hi, tid.lo)] = Task(tid, kind, key, list(targets), source, client_id,
                                            wall_ms, wall_ms, now)
        return 0, tid

    def _check(self, kind: str, key: str, targets: list[str], source: str) -> int:
        obj = self._st.objects.get(key)
        if obj is None or not obj.complete:
            return ObjectNotFound.code
        if kind not in ("copy", "move") or not targets:
            return InvalidParams.code
        if any(t not in self._st.segments for t in targets):
            return InvalidParams.code
        if kind == "move":
            holders = {s for s, _, _ in obj.replicas}
            if len(targets) != 1 or source == targets[0] or source not in holders:
                return InvalidParams.code
        return 0

    # -- run ------------------------------------------------------------------------------------
    def start(self, tid: TaskId, client_id: str, now: float, wall_ms: int) -> TaskWork:
        """Allocate the task's targets and hand its copy to the runner (PROCESSING)."""
        task = self.tasks.get((tid.hi, tid.lo))
        if task is None:
            return TaskWork(TASK_NOT_FOUND)
        if task.status is not PENDING:
            return TaskWork(InvalidParams.code)
        st = self._st
        obj = st.objects.get(task.key)
        if obj is None or not obj.complete:
            self._fail(task, "object is gone", wall_ms)
            return TaskWork(ObjectNotFound.code)
        if task.kind == "move" and task.source not in {s for s, _, _ in obj.replicas}:
            self._fail(task, "source replica is gone", wall_ms)
            return TaskWork(InvalidParams.code)
        holders = {s for s, _, _ in obj.replicas}
        task.size = obj.hdr + obj.size  # the whole allocation (fences and frees)
        for name in task.targets:
            seg = st.segments.get(name)
            if name in holders or seg is None:
                continue
            off = seg.alloc.allocate(obj.hdr + obj.size)
            if off is None:
                self._free(task)
                self._fail(task, "NO_AVAILABLE_HANDLE: no room on " + name, wall_ms)
                return TaskWork(-200)
            task.allocated.append((name, off, st.new_generation()))  # the runner's frames carry it
        task.status, task.updated_ms, task.since = PROCESSING, wall_ms, now
        task.client_id = client_id
        obj.lease_until = max(obj.lease_until, now + self.processing_timeout)
        sources = obj.replicas_of(st.segments, [r for r in obj.replicas
                                                if task.kind == "copy" or r[0] == task.source])
        targets = obj.replicas_of(st.segments, task.allocated)
        headers = [inventory.pack(st.secret, task.key, g, obj.version, obj.size, obj.checksum,
                                  obj.want, obj.flags) if obj.hdr else b"" for _s, _o, g in
                   task.allocated]  # written by the runner once the value landed
        return TaskWork(0, obj.size, sources, targets, headers)

    def finish(self, tid: TaskId, ok: list[bool], message: str, now: float, wall_ms: int) -> int:
        """The runner's report; 0, or TASK_NOT_FOUND / INVALID_PARAMS."""
        task = self.tasks.get((tid.hi, tid.lo))
        if task is None:
            return TASK_NOT_FOUND
        if task.status is not PROCESSING or len(ok) != len(task.allocated):
            return InvalidParams.code
        st = self._st
        obj = st.objects.get(task.key)
        done = [a for a, good in zip(task.allocated, ok) if good]
        failed = [a for a, good in zip(task.allocated, ok) if not good]
        for seg, off, gen in failed:  # the runner reported: nothing of it is in flight
            if seg in st.segments:
                st.adoption.forget(st.segments[seg], off, gen)  # a header it may have written
                st.segments[seg].alloc.free(off, task.size)
        if obj is None or not obj.complete:
            task.allocated = done
            self._free(task)
            self._fail(task, "object removed during the task", wall_ms)
            return 0
        obj.replicas += tuple(a for a in done if a[0] in st.segments)
        obj.want = max(obj.want, len(obj.replicas) - (task.kind == "move"))  # repairs keep them
        # the task's protection ends with it; a reader's lease taken meanwhile is kept
        obj.lease_until = min(obj.lease_until, now + st.config.lease_ttl)
        if failed or (task.kind == "move" and not done and task.allocated):
            task.allocated = []
            self._fail(task, message or "a target write failed", wall_ms)
            return 0
        if task.kind == "move":
            self._drop_source(obj, task.source, now)
        task.allocated = []
        task.status, task.updated_ms, task.message = TaskStatus.SUCCESS, wall_ms, message or "ok"
        self._prune()
        return 0

    def _drop_source(self, obj: Row, source: str, now: float) -> None:
        """Take the source replica out of ``obj``; a reader inside its lease may still be
        copying from it, so its space waits for the lease like a removed object's."""
        self._st.drop_replicas(obj, {source}, now)

    # -- query and housekeeping --------------------------------------------------------------------
    def query(self, tid: TaskId) -> TaskInfo:
        task = self.tasks.get((tid.hi, tid.lo))
        if task is None:
            return TaskInfo(TASK_NOT_FOUND)
        return TaskInfo(0, task.kind, task.status.value, task.created_ms, task.updated_ms,
                        task.client_id, task.message)

    def expire(self, now: float, wall_ms: int) -> int:
        """Fail tasks stuck PENDING or PROCESSING past their timeouts; returns how many."""
        n = 0
        for task in self.tasks.values():  # allocations on segments that went, went with them
            if task.allocated:
                task.allocated = [a for a in task.allocated if a[0] in self._st.segments]
        for task in list(self.tasks.values()):
            limit = (self.pending_timeout if task.status is PENDING else
                     self.processing_timeout if task.status is PROCESSING else None)
            if limit and now - task.since > limit:
                self._free(task, now)
                self._fail(task, f"timed out {task.status.value.lower()}", wall_ms)
                n += 1
        return n

    def drop_segment(self, name: str) -> None:
        """Segment ``name`` went away: its allocations went with it."""
        for task in self.tasks.values():
            task.allocated = [a for a in task.allocated if a[0] != name]

    def _free(self, task: Task, now: float | None = None) -> None:
        """Give a task's target space back: at once when its runner is not writing (never
        started, or reported), else (``now`` given: abandoned while PROCESSING) only after
        the target segment fenced the allocation, as an abandoned put's space."""
        st = self._st
        for seg, off, gen in task.allocated:
            if seg not in st.segments:
                continue
            st.adoption.forget(st.segments[seg], off, gen)
            if now is not None and task.status is PROCESSING:
                st.graveyard.hold(seg, off, task.size, now, gen)
            else:
                st.segments[seg].alloc.free(off, task.size)
        task.allocated = []

    def _fail(self, task: Task, message: str, wall_ms: int) -> None:
        task.status, task.message, task.updated_ms = TaskStatus.FAILED, message, wall_ms
        self._prune()

    def _prune(self) -> None:
        finished = [k for k, t in self.tasks.items() if t.status in FINISHED]
        for k in finished[:max(0, len(finished) - self.max_finished)]:
            del self.tasks[k]
