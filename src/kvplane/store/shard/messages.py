"""The shard RPCs' messages: moving slots (export, import, release), re-cutting a segment's
shares, installing a map, a shard's own status. Shared by the masters (``role.py``,
``move_rpc.py``) and the clients (``session.py``, ``mover.py``); pure msgspec structs.
"""

from __future__ import annotations

import msgspec

from kvplane.store.shard.slots import ShardMap
from kvplane.store.types import KeyResult, MountRep, SegmentInfo


class SetMapReq(msgspec.Struct):
    """Install ``map`` if newer; ``expect``: only while this shard's epoch is still that one
    (a shard that restarted or failed over meanwhile lost a move's state)."""

    map: ShardMap
    expect: int = 0


class StatusReq(msgspec.Struct):
    """Ask a shard for its own status document (``shard_status``)."""

    admin: bool = False
    history: bool = False


class ExportReq(msgspec.Struct):
    """The source's objects of slots ``ranges`` (``[first, end)``); ``freeze``: no put of
    them may end from now on, and list them."""

    ranges: list[tuple[int, int]]
    freeze: bool = False
    expect: int = 0  # the source's epoch as the mover first saw it (0: any)


class Exported(msgspec.Struct, array_like=True):
    """One object to move: its internal key, its replicas (under a read lease), the replicas
    it wants and whether it is hard-pinned."""

    key: str
    result: KeyResult
    want: int
    hard_pin: bool


class ExportRep(msgspec.Struct):
    epoch: int
    pending: int  # puts of those slots still open
    objects: list[Exported] = msgspec.field(default_factory=list)
    ttl: float = 0.0  # seconds the read leases last from the request's receipt


class ImportReq(msgspec.Struct):
    """PutStarts on the target of moved objects (internal keys)."""

    client_id: str
    keys: list[str]
    sizes: list[int]
    checksums: list[int]
    wants: list[int]
    pins: list[bool]
    ttl: float = 0.0
    nonce: int = 0
    expect: int = 0  # the target's epoch as the mover first saw it


class ImportEndReq(msgspec.Struct):
    keys: list[str]
    versions: list[int]
    checksums: list[int]
    expect: int = 0


class ReleaseReq(msgspec.Struct):
    """Drop the objects of slots ``ranges`` that this shard does not own (any more)."""

    ranges: list[tuple[int, int]]


class ReshareReq(msgspec.Struct):
    """Mount ``segment`` (this shard's new share of it) for client ``client_id``. ``shrink``:
    the share keeps its base and may end anywhere from ``segment.size`` up to what it has:
    the shard keeps the smallest end past which all its space is free."""

    client_id: str
    segment: SegmentInfo
    shrink: bool = False


class ReshareRep(msgspec.Struct):
    mount: MountRep
    size: int  # the share's size as mounted (shrink: where its free tail began)
    fresh: bool  # the shard did not have a share of this segment before
