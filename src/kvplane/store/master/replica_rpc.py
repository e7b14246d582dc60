"""The master's replica RPCs: descriptors, replica clear, copy/move tasks (Mooncake's
GetReplicaList-for-introspection, BatchReplicaClear, CreateCopyTask/CreateMoveTask/QueryTask).

``handlers(serving)`` returns them for the server to register (once, at start); each runs
under the server's state lock like every other handler. Descriptors take no lease. The disk
tier adds its replicas in ``_replica_infos`` (the one place that lists an object's replicas by
tier). The task table is the served state's (``MasterState.tasks``): tasks do not survive a
leader change (their runners see TASK_NOT_FOUND and the targets were never joined).

An RPC module: imports the state, the table's records and the wire types; never the server.
Binds nothing itself.
"""

from __future__ import annotations

import time

from kvplane.store.errors import ObjectNotFound
from kvplane.store.master.rows import Row
from kvplane.store.master.serving import Handlers, Serving
from kvplane.store.replica_types import (
    LOCAL_DISK,
    MEMORY,
    DescRep,
    DescResult,
    ReplicaClearReq,
    ReplicaInfo,
    TaskCreateRep,
    TaskCreateReq,
    TaskDoneReq,
    TaskInfo,
    TaskReq,
    TaskWork,
)
from kvplane.store.types import KeysReq


def _wall_ms() -> int:
    return int(time.time() * 1000)


def handlers(serving: Serving) -> Handlers:
    """The replica RPCs, by method name, for the server to register."""
    rpc = ReplicaRpc(serving)
    return {
        "replica_descs": (rpc.descs, KeysReq), "replica_clear": (rpc.clear, ReplicaClearReq),
        "task_create": (rpc.task_create, TaskCreateReq), "task_start": (rpc.task_start, TaskReq),
        "task_done": (rpc.task_done, TaskDoneReq), "task_query": (rpc.task_query, TaskReq),
    }


def tick(serving: Serving) -> None:
    """Timer pass (under the lock): expire stuck copy/move tasks."""
    serving.state.tasks.expire(serving.clock(), _wall_ms())


class ReplicaRpc:
    """Handlers over the served state (see the module docstring).

    Args:
        serving: the state being served and the clock.
    """

    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    # -- descriptors -------------------------------------------------------------------------------
    def _replica_infos(self, obj: Row) -> list[ReplicaInfo]:
        status = "COMPLETE" if obj.complete else "PROCESSING"
        segs = self.serving.state.segments
        return [ReplicaInfo(MEMORY, status, obj.size, rep) for rep in
                obj.replicas_of(segs, [r for r in obj.replicas if r[0] in segs])] + \
            [ReplicaInfo(LOCAL_DISK, status, obj.size, None, path)  # SSD copies (tiers.py)
             for seg, path in obj.disk.items() if seg in segs]

    def descs(self, req: KeysReq) -> DescRep:
        out = []
        for key in req.keys:
            obj = self.serving.state.objects.get(key)
            if obj is None:
                out.append(DescResult(ObjectNotFound.code))
            else:
                out.append(DescResult(0, self._replica_infos(obj)))
        return DescRep(out)

    # -- replica clear -------------------------------------------------------------------------------
    def clear(self, req: ReplicaClearReq) -> list[str]:
        """Keys whose replicas went: only the caller's own, complete objects with no live
        lease; with a segment name only the replicas there (an object left with none goes)."""
        st, now = self.serving.state, self.serving.clock()
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
            elif any(s == req.segment for s, _, _ in obj.replicas):
                st.drop_replicas(obj, {req.segment}, now)
                if not obj.replicas:
                    st.remove(key, True, now)
                else:  # asked for: re-replication must not put it back
                    obj.want = min(obj.want, len(obj.replicas))
                cleared.append(key)
        return cleared

    # -- tasks ---------------------------------------------------------------------------------------
    def task_create(self, req: TaskCreateReq) -> TaskCreateRep:
        code, tid = self.serving.state.tasks.create(req.kind, req.key, req.targets, req.source,
                                                    req.client_id, self.serving.clock(), _wall_ms())
        return TaskCreateRep(code, tid)

    def task_start(self, req: TaskReq) -> TaskWork:
        return self.serving.state.tasks.start(req.task, req.client_id, self.serving.clock(),
                                              _wall_ms())

    def task_done(self, req: TaskDoneReq) -> int:
        return self.serving.state.tasks.finish(req.task, req.ok, req.message,
                                               self.serving.clock(), _wall_ms())

    def task_query(self, req: TaskReq) -> TaskInfo:
        return self.serving.state.tasks.query(req.task)
