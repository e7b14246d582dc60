"""Wire types of the SSD tier: disk replicas, offload and promotion tasks, and their RPCs.

Kept apart from ``store.types`` (the put/get path). Pure msgspec structs; imports only
``kvplane.store.inventory`` (the record a node re-registers).
"""

from __future__ import annotations

import hashlib

import msgspec

from kvplane.store.inventory import Record


class DiskReplica(msgspec.Struct, array_like=True, gc=False):
    """A disk copy of an object: held by the owner of ``segment``, served through its disk RPC
    at ``endpoint`` (Mooncake's LOCAL_DISK replica, whose endpoint is the client's RPC).

    ``key`` is the object's key as the master stores it (tenant-scoped) and ``ticket`` the
    master's keyed hash over key, version and segment: the node serves a read only with it, so
    a client can load exactly the objects the master listed for it (``ticket_of``)."""

    segment: str
    endpoint: str
    path: str
    size: int
    key: str = ""
    ticket: bytes = b""


def ticket_of(secret: bytes, key: str, version: int, segment: str) -> bytes:
    """The read ticket of one disk copy (keyed by the service token's inventory secret)."""
    h = hashlib.blake2b(digest_size=16, key=secret, person=b"kvplane-disk")
    h.update(version.to_bytes(8, "little") + segment.encode() + b"\0" + key.encode())
    return h.digest()


class OffloadTask(msgspec.Struct, array_like=True):
    """Copy the allocation at ``addr`` (``[header][value]``, ``hdr`` + ``size`` bytes) of
    ``key`` version ``version`` from this node's memory to its disk."""

    key: str
    version: int
    addr: int
    hdr: int
    size: int
    checksum: int
    gen: int


class OffloadResult(msgspec.Struct, array_like=True):
    key: str
    version: int
    ok: bool
    path: str = ""


class DiskSyncReq(msgspec.Struct):
    """A disk node's poll: offloads it finished, disk copies it lost (quota eviction or a
    corrupt file), forgets it carried out."""

    client_id: str
    done: list[OffloadResult] = msgspec.field(default_factory=list)
    lost: list[tuple[str, int]] = msgspec.field(default_factory=list)  # (key, version)


class DiskSyncRep(msgspec.Struct):
    """Offloads to run, disk copies to delete (``(key, version)``), and the results of
    ``done`` (False: the master did not take the copy; delete the file)."""

    offloads: list[OffloadTask] = msgspec.field(default_factory=list)
    forgets: list[tuple[str, int]] = msgspec.field(default_factory=list)
    taken: list[bool] = msgspec.field(default_factory=list)


class DiskAdoptReq(msgspec.Struct):
    """The disk copies a node holds, re-registered (``records[i]`` in file ``paths[i]``)."""

    client_id: str
    segment: str
    records: list[Record]
    paths: list[str]
    history: list[int] = msgspec.field(default_factory=list)


class PromoteReq(msgspec.Struct):
    """Node -> master: allocations for reading these disk copies back into memory."""

    client_id: str
    keys: list[str]
    versions: list[int]


class PromoteTask(msgspec.Struct, array_like=True):
    """``code`` 0: read the file image into ``addr`` (the allocation's start; the value
    follows ``hdr`` bytes later) and restamp it with ``gen``. 1: nothing to do (in memory
    already, or another promotion of it is under way). < 0: an error code."""

    code: int
    addr: int = 0
    gen: int = 0
    hdr: int = 0
    size: int = 0


class PromoteRep(msgspec.Struct):
    tasks: list[PromoteTask]


class PromoteEndReq(msgspec.Struct):
    client_id: str
    keys: list[str]
    gens: list[int]
    ok: list[bool]


class LoadReq(msgspec.Struct):
    """Reader -> disk node: bring these objects into memory (read-through)."""

    keys: list[str]  # as the master stores them (``DiskReplica.key``)
    versions: list[int]
    inline: bool = True  # small values may come back in the reply (else: promoted first)
    tickets: list[bytes] = msgspec.field(default_factory=list)  # ``DiskReplica.ticket`` each


class LoadRep(msgspec.Struct):
    """Per key: code 0 (in memory now, or its bytes in ``data``), 1 (retry), < 0 (an error);
    ``data[i]``: the value itself when it was served from disk directly (small objects)."""

    codes: list[int]
    data: list[bytes] = msgspec.field(default_factory=list)
