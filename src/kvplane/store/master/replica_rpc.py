"""The master's replica RPCs: descriptors, replica clear, copy/move tasks (Mooncake's
GetReplicaList-for-introspection, BatchReplicaClear, CreateCopyTask/CreateMoveTask/QueryTask).

``install(server)`` registers them on a ``MasterServer``; each runs under the server's state lock
like every other handler. Descriptors take no lease. The disk tier, when it comes, adds its
replicas in ``_replica_infos`` (the one place that lists an object's replicas by tier).

Imports the master state and wire types; binds nothing itself.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvplane.store.errors import ObjectNotFound
from kvplane.store.master.state import Obj
from kvplane.store.master.tasks import Tasks
from kvplane.store.replica_types import (
    LOCAL_DISK, MEMORY, DescRep, DescResult, ReplicaClearReq, ReplicaInfo, TaskCreateRep, TaskCreateReq,
    TaskDoneReq, TaskInfo, TaskReq, TaskWork,
)
from kvplane.store.types import KeysReq

if TYPE_CHECKING:
    from kvplane.store.master.server import MasterServer
    from kvplane.store.master.state import MasterState


def _wall_ms() -> int:
    return int(time.time() * 1000)


class ReplicaRpc:
    """Handlers bound to one master (see the module docstring)."""

    def __init__(self, server: "MasterServer") -> None:
        self.server = server
        self._tasks = Tasks(server.state)

    @property
    def state(self) -> "MasterState":
        """The server's current state (a new leader term starts a new one)."""
        return self.server.state

    @property
    def tasks(self) -> Tasks:
        """The task table of the current state (tasks do not survive a leader change: their
        runners see TASK_NOT_FOUND and the targets were never joined)."""
        if self._tasks._st is not self.server.state:
            self._tasks = Tasks(self.server.state)
        return self._tasks

    def install(self) -> None:
        for name, fn, typ in (
            ("replica_descs", self.descs, KeysReq),
            ("replica_clear", self.clear, ReplicaClearReq),
            ("task_create", self.task_create, TaskCreateReq),
            ("task_start", self.task_start, TaskReq),
            ("task_done", self.task_done, TaskDoneReq),
            ("task_query", self.task_query, TaskReq),
        ):
            self.server.add_handler(name, fn, typ)

    # -- descriptors -------------------------------------------------------------------------------
    def _replica_infos(self, obj: Obj) -> list[ReplicaInfo]:
        status = "COMPLETE" if obj.complete else "PROCESSING"
        segs = self.state.segments
        return [ReplicaInfo(MEMORY, status, obj.size, rep) for rep in
                obj.replicas_of(segs, [r for r in obj.replicas if r[0] in segs])] + \
            [ReplicaInfo(LOCAL_DISK, status, obj.size, None, path)  # SSD copies (tiers.py)
             for seg, path in obj.disk.items() if seg in segs]

    def descs(self, req: KeysReq) -> DescRep:
        out = []
        for key in req.keys:
            obj = self.state.objects.get(key)
            if obj is None:
                out.append(DescResult(ObjectNotFound.code))
            else:
                out.append(DescResult(0, self._replica_infos(obj)))
        return DescRep(out)

    # -- replica clear -------------------------------------------------------------------------------
    def clear(self, req: ReplicaClearReq) -> list[str]:
        """Keys whose replicas went: only the caller's own, complete objects with no live
        lease; with a segment name only the replicas there (an object left with none goes)."""
        st, now = self.state, self.server.clock()
        cleared = []
        for key in req.keys:
            obj = st.objects.get(key)
            if obj is None or not obj.complete or obj.owner != req.client_id:
                continue
            if obj.lease_until > now:
                continue
            if not req.segment:
                st.remove(key, False, now)
                cleared.append(key)
            elif any(r[0] == req.segment for r in obj.replicas):
                st.drop_replicas(obj, {req.segment}, now)
                if not obj.replicas:
                    st.remove(key, True, now)
                else:  # asked for: re-replication must not put it back
                    obj.want = min(obj.want, len(obj.replicas))
                cleared.append(key)
        return cleared

    # -- tasks ---------------------------------------------------------------------------------------
    def task_create(self, req: TaskCreateReq) -> TaskCreateRep:
        code, tid = self.tasks.create(req.kind, req.key, req.targets, req.source, req.client_id,
                                      self.server.clock(), _wall_ms())
        return TaskCreateRep(code, tid)

    def task_start(self, req: TaskReq) -> TaskWork:
        return self.tasks.start(req.task, req.client_id, self.server.clock(), _wall_ms())

    def task_done(self, req: TaskDoneReq) -> int:
        return self.tasks.finish(req.task, req.ok, req.message, self.server.clock(), _wall_ms())

    def task_query(self, req: TaskReq) -> TaskInfo:
        return self.tasks.query(req.task)

    def tick(self) -> None:
        """Timer pass (under the lock): expire stuck tasks."""
        self.tasks.expire(self.server.clock(), _wall_ms())
