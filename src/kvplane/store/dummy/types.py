"""Wire types between a dummy client and its client server. Addresses are the dummy's own; the
server maps them through the shared-memory regions the dummy attached."""

from __future__ import annotations

import msgspec

from kvplane.store.replica_types import TaskId
from kvplane.store.types import KeyResult, ReplicateConfig


class AttachReq(msgspec.Struct):
    """Map the dummy's shared memory ``shm`` (at ``addr`` in the dummy, ``size`` bytes)."""

    session: str
    pid: int
    shm: str
    addr: int
    size: int


class SessionReq(msgspec.Struct):
    session: str


class PutReq(msgspec.Struct):
    session: str
    keys: list[str]
    addrs: list[int]
    sizes: list[int]
    config: ReplicateConfig | None = None
    upsert: bool = False


class GetReq(msgspec.Struct):
    session: str
    keys: list[str]
    addrs: list[int]
    sizes: list[int]


class KeysOp(msgspec.Struct):
    """A keyed call: exists, sizes, remove, descs, clear, lookup, commit, revoke."""

    session: str
    keys: list[str]
    force: bool = False
    segment: str = ""


class PatternReq(msgspec.Struct):
    session: str
    pattern: str = ""
    force: bool = False


class PerKey(msgspec.Struct):
    """Per key: a value >= 0 or a negative code (an error's code)."""

    codes: list[int]


class TaskOp(msgspec.Struct):
    session: str
    kind: str = ""
    key: str = ""
    targets: list[str] = msgspec.field(default_factory=list)
    source: str = ""
    task: TaskId | None = None


class RangeOp(msgspec.Struct):
    """Range reads/writes of one object the dummy looked up or reserved."""

    session: str
    result: KeyResult
    ranges: list[tuple[int, int, int]]  # (object offset, dummy address, size)
    write: bool = False
    lease_end_in: float = 0.0  # seconds of read lease left when sent


class ReserveReq(msgspec.Struct):
    session: str
    keys: list[str]
    sizes: list[int]
    config: ReplicateConfig | None = None


class CommitReq(msgspec.Struct):
    """PutEnd / PutRevoke of reserved objects, with the results their reservation gave."""

    session: str
    keys: list[str]
    results: list[KeyResult]


class LookupRep(msgspec.Struct):
    results: list[KeyResult]
    lease_left: float


class Hello(msgspec.Struct):
    """The server's answer to attach: its segment name and protocol version."""

    segment: str
    version: int = 1
