"""``MooncakeDistributedStore``'s replica calls: descriptors, ``batch_replica_clear``, the
copy/move task API, and the segment-mount calls.

* ``get_replica_desc(key)`` / ``batch_get_replica_desc(keys)``: ReplicaDescriptors (status,
  tier, buffer descriptor with ``transport_endpoint`` = the segment name); no lease is taken.
  Every replica is a memory replica until the SSD tier lands; its descriptors will carry
  ``tier="local_disk"`` and a DiskDescriptor (``kvplane.store.replica_types``).
* ``create_copy_task`` / ``create_move_task`` -> ``((hi, lo), code)``; ``query_task(id)`` ->
  ``(QueryTaskResponse | None, code)``. The copy is made by this client (its task runner), which
  is also the task's ``assigned_client``.
* ``mount_segment`` & co.: a kvplane client contributes exactly one segment (its
  ``global_segment_size``); extra segments are NOT_SUPPORTED (-1012) here.

A mixin of ``mooncake_store.MooncakeDistributedStore``; imports ``kvplane.store`` only.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

from kvplane.common.errors import KVPlaneError
from kvplane.compat.mooncake_types import (
    INVALID_PARAMS,
    NOT_SUPPORTED,
    Descriptor,
    DiskDescriptor,
    QueryTaskResponse,
    ReplicaDescriptor,
    ReplicaStatus,
    TaskStatus,
    TaskType,
    code_of,
)
from kvplane.store.client.replica_ops import ReplicaOps
from kvplane.store.replica_types import MEMORY, ReplicaInfo, TaskId

log = logging.getLogger(__name__)


def _uuid_pair(client_id: str) -> tuple[int, int]:
    try:
        value = uuid.UUID(hex=client_id).int
    except ValueError:
        value = uuid.uuid5(uuid.NAMESPACE_OID, client_id).int
    return value >> 64, value & ((1 << 64) - 1)


def descriptor_of(info: ReplicaInfo) -> ReplicaDescriptor:
    """A Mooncake ReplicaDescriptor for one replica the master listed."""
    status = ReplicaStatus.__members__.get(info.status, ReplicaStatus.UNDEFINED)
    if info.tier == MEMORY and info.replica is not None:
        rep = info.replica
        return ReplicaDescriptor(status, memory=Descriptor(rep.size, rep.addr, rep.segment),
                                 tier=MEMORY, segment=rep.segment)
    return ReplicaDescriptor(status, disk=DiskDescriptor(info.file_path, info.size),
                             tier=info.tier)


class AdminMixin:
    """See the module docstring."""

    _c: Any

    def __init__(self) -> None:
        self._replica_ops: ReplicaOps | None = None

    def _close(self) -> None:
        ops, self._replica_ops = self._replica_ops, None
        if ops is not None:
            ops.close()

    def _ops(self) -> Any:
        if self._replica_ops is None:
            self._replica_ops = (self._c.replica_ops() if hasattr(self._c, "replica_ops")
                                 else ReplicaOps(self._c))
        return self._replica_ops

    # -- descriptors ------------------------------------------------------------------------------
    def get_replica_desc(self, key: str) -> list[ReplicaDescriptor]:
        """The key's replicas ([] when missing or on any failure)."""
        return self.batch_get_replica_desc([key]).get(key, [])

    def batch_get_replica_desc(self, keys: Sequence[str]) -> dict[str, list[ReplicaDescriptor]]:
        """key -> its replicas; keys that are missing map to []."""
        keys = list(keys)
        if self._c is None or not keys:
            return {k: [] for k in keys}
        try:
            results = self._ops().descs(keys)
        except KVPlaneError as exc:
            log.warning("batch_get_replica_desc failed: %s", exc)
            return {k: [] for k in keys}
        return {k: [descriptor_of(i) for i in r.replicas] if r.code == 0 else []
                for k, r in zip(keys, results)}

    def batch_replica_clear(self, keys: Sequence[str], segment_name: str = "") -> list[str]:
        """Clear this client's objects whose read leases ended: all their replicas, or only
        those on ``segment_name``. Returns the keys cleared ([] on failure)."""
        keys = [k for k in keys if k]
        if self._c is None or not keys:
            return []
        try:
            return list(self._ops().clear(keys, segment_name))
        except KVPlaneError as exc:
            log.warning("batch_replica_clear failed: %s", exc)
            return []

    # -- copy/move tasks -----------------------------------------------------------------------------
    def _create(self, kind: str, key: str, targets: list[str],
                source: str = "") -> tuple[tuple[int, int], int]:
        if self._c is None:
            return (0, 0), INVALID_PARAMS
        try:
            rep = self._ops().create_task(kind, key, targets, source)
        except KVPlaneError as exc:
            return (0, 0), code_of(exc)
        return (rep.task.hi, rep.task.lo) if rep.code == 0 else (0, 0), rep.code

    def create_copy_task(self, key: str, targets: Sequence[str]) -> tuple[tuple[int, int], int]:
        """Copy ``key`` to each segment of ``targets``: ``(task id, 0)`` or ``((0, 0), code)``
        (-704 no such key, -600 an unknown segment)."""
        return self._create("copy", key, [str(t) for t in targets])

    def create_move_task(self, key: str, source: str, target: str) -> tuple[tuple[int, int], int]:
        """Move ``key``'s replica on ``source`` to ``target`` (-600: unknown segment, same
        segment, or no replica on ``source``)."""
        return self._create("move", key, [str(target)], str(source))

    def query_task(self, task_id: Any) -> tuple[QueryTaskResponse | None, int]:
        """``(QueryTaskResponse, 0)`` or ``(None, code)`` (-1400 unknown or pruned task)."""
        if self._c is None:
            return None, INVALID_PARAMS
        try:
            hi, lo = (task_id.int >> 64, task_id.int & ((1 << 64) - 1)) \
                if isinstance(task_id, uuid.UUID) else (int(task_id[0]), int(task_id[1]))
        except (TypeError, ValueError, IndexError):
            raise TypeError(f"query_task: expected a (hi, lo) task id, got {task_id!r}") from None
        try:
            info = self._ops().query_task(TaskId(hi, lo))
        except KVPlaneError as exc:
            return None, code_of(exc)
        if info.code:
            return None, info.code
        resp = QueryTaskResponse()
        resp.id = (hi, lo)
        resp.type = TaskType.REPLICA_MOVE if info.kind == "move" else TaskType.REPLICA_COPY
        resp.status = TaskStatus[info.status]
        resp.created_at_ms_epoch = info.created_ms
        resp.last_updated_at_ms_epoch = info.updated_ms
        resp.assigned_client = _uuid_pair(info.assigned_client) if info.assigned_client else (0, 0)
        resp.message = info.message
        return resp, 0

    # -- segments ----------------------------------------------------------------------------------
    def mount_segment(self, path: str, size: int, offset: int = 0, protocol: str = "tcp",
                      location: str = "") -> dict[str, Any]:
        """Not here: a kvplane client contributes one segment, sized at setup."""
        log.error("mount_segment: a kvplane client contributes one segment (global_segment_size)")
        return {"ret": NOT_SUPPORTED if self._c is not None else INVALID_PARAMS,
                "segment_ids": []}

    def allocate_and_mount_segment(self, size: int, protocol: str = "tcp",
                                   location: str = "") -> dict[str, Any]:
        out = self.mount_segment("", size, 0, protocol, location)
        out["allocated_size"] = 0
        return out

    def unmount_segment(self, segment_ids: Sequence[str], grace_period_seconds: int = 0) -> int:
        return NOT_SUPPORTED if self._c is not None else INVALID_PARAMS

    def unmount_and_free_segment(self, segment_ids: Sequence[str],
                                 grace_period_seconds: int = 0) -> int:
        return NOT_SUPPORTED if self._c is not None else INVALID_PARAMS

    def unmount_local_disk_segment(self, grace_period_seconds: int = 0) -> int:
        return NOT_SUPPORTED if self._c is not None else INVALID_PARAMS
