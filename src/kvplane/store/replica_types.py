"""Wire types of the master's replica RPCs: descriptors, replica clear, copy/move tasks.

Kept apart from ``store.types`` (the put/get path) so each can change on its own. Pure msgspec
structs; imports nothing else from kvplane.
"""

from __future__ import annotations

import msgspec

from kvplane.store.types import Grant, Replica

# replica tiers (Mooncake's ReplicaType names); the SSD tier adds "local_disk" and "disk"
MEMORY = "memory"
LOCAL_DISK = "local_disk"
DISK = "disk"


class ReplicaInfo(msgspec.Struct, array_like=True):
    """One replica as a descriptor shows it.

    ``tier``: "memory" (``replica`` set), or a disk tier (``file_path`` set, ``replica`` None).
    ``status``: Mooncake's ReplicaStatus name ("COMPLETE", "PROCESSING", ...).
    """

    tier: str
    status: str
    size: int
    replica: Replica | None = None
    file_path: str = ""


class DescResult(msgspec.Struct, array_like=True):
    """Per key: code 0 and its replicas, or a negative code (-704 missing)."""

    code: int
    replicas: list[ReplicaInfo] = msgspec.field(default_factory=list)


class DescRep(msgspec.Struct):
    results: list[DescResult]


class ReplicaClearReq(msgspec.Struct):
    client_id: str
    keys: list[str]
    segment: str = ""


class TaskCreateReq(msgspec.Struct):
    """A copy (``targets``) or a move (``source`` -> ``targets[0]``) of ``key``."""

    client_id: str
    kind: str  # "copy" | "move"
    key: str
    targets: list[str]
    source: str = ""


class TaskId(msgspec.Struct, array_like=True):
    """A task id: Mooncake's UUID as two unsigned 64-bit halves."""

    hi: int
    lo: int


class TaskCreateRep(msgspec.Struct):
    code: int
    task: TaskId = msgspec.field(default_factory=lambda: TaskId(0, 0))


class TaskReq(msgspec.Struct):
    client_id: str
    task: TaskId


class TaskInfo(msgspec.Struct):
    """What ``query_task`` reports."""

    code: int
    kind: str = "copy"
    status: str = "PENDING"  # PENDING | PROCESSING | SUCCESS | FAILED
    created_ms: int = 0
    updated_ms: int = 0
    assigned_client: str = ""
    message: str = ""


class TaskWork(msgspec.Struct):
    """The copy a task's runner performs: read ``size`` bytes from one of ``sources``, write
    them to every one of ``targets``. ``code`` < 0: nothing to do (the task failed)."""

    code: int
    size: int = 0
    sources: list[Replica] = msgspec.field(default_factory=list)
    targets: list[Replica] = msgspec.field(default_factory=list)
    headers: list[bytes] = msgspec.field(default_factory=list)  # per target: its inventory
    # header, written in the bytes just before the target's value once the value landed
    grants: list[Grant] | None = None  # to a tenant's runner: READ sources, WRITE targets


class TaskDoneReq(msgspec.Struct):
    client_id: str
    task: TaskId
    ok: list[bool]  # per target
    message: str = ""
