"""Store wire types: replicate config, replica descriptors, and master RPC messages."""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from kvplane.store.inventory import Record
from kvplane.store.tier_types import DiskReplica

MAX_KEY = 4096  # bytes of a key
MAX_VALUE = 1 << 40  # bytes of one object
# one ``list_keys`` answer carries at most this many keys and, past its first key, at most this
# many bytes of keys (10,000 keys of 4 KiB would be 40 MiB, over the 16 MiB control frame); a
# longer listing is read in pages (``ListKeysReq.after``)
MAX_LIST_KEYS = 10_000
MAX_LIST_BYTES = 4 << 20


class ReplicateConfig(msgspec.Struct, kw_only=True):
    """How an object is placed (Mooncake's ReplicateConfig fields).

    Soft pin: ``soft_pin_action`` "enable" (or the older ``with_soft_pin=True``) pins the object
    for ``soft_pin_ttl_ms`` (default: the master's) from the moment it becomes readable;
    "preserve" (the default) keeps the deadline of the object an upsert replaces; "disable"
    drops it. A TTL with any action but "enable" is INVALID_PARAMS, as in Mooncake.
    ``group_id``: the object's routing group ("" none).
    """

    replica_num: int = 1
    with_hard_pin: bool = False
    with_soft_pin: bool = False
    soft_pin_action: str = ""  # "", "preserve", "enable", "disable" ("" follows with_soft_pin)
    soft_pin_ttl_ms: int | None = None
    preferred_segment: str = ""
    preferred_segments: list[str] = msgspec.field(default_factory=list)
    prefer_alloc_in_same_node: bool = False
    group_id: str = ""

    def pin_action(self) -> str:
        """The effective soft-pin action."""
        return self.soft_pin_action or ("enable" if self.with_soft_pin else "preserve")


class Replica(msgspec.Struct, array_like=True, gc=False):
    """One memory replica: a contiguous buffer in a segment (Mooncake's buffer descriptor)."""

    segment: str
    addr: int
    size: int
    endpoint: str = ""  # transfer-engine endpoint (host:port) of the segment
    host_id: str = ""
    gen: int = 0  # the allocation's generation: data frames carry it, the segment checks it


class SegmentInfo(msgspec.Struct):
    """A mounted segment as the master records it."""

    name: str
    base: int
    size: int
    client_id: str
    endpoint: str
    host_id: str
    used: int = 0
    disk_size: int = 0  # bytes of the owner's SSD tier (0: none)
    disk_endpoint: str = ""  # the owner's disk RPC (read-through), host:port
    write_through: bool = False  # copy every committed object to disk (else: ahead of eviction)


# --- RPC messages ----------------------------------------------------------------------
class MountReq(msgspec.Struct):
    """``history``: the master epochs this client's segments mounted with, oldest first;
    ``adopt``: it will re-register what they hold (``AdoptReq``) before taking placements."""

    client_id: str
    segments: list[SegmentInfo]
    history: list[int] = msgspec.field(default_factory=list)
    adopt: bool = False


class MountRep(msgspec.Struct):
    """The master's epoch, and the lowest generation it issues from now on (the fence floor).
    ``secret``: the key of the inventory headers' tags, sent only to a mount that brings
    segments (only the service token may: tenants never learn it)."""

    epoch: int
    floor: int = 0
    secret: bytes = b""
    # to a mount that brings segments: the identities of the master's tenants
    # (``kvplane.transfer.grants.tenant_id``), whose data connections need grants
    tenants: list[bytes] = msgspec.field(default_factory=list)
    tenant: str = ""  # the caller's tenant when it is not ``default`` (its transfers go by TCP)


class AdoptReq(msgspec.Struct):
    """Records one segment holds, re-registered with a master that does not know them."""

    client_id: str
    segment: str
    records: list[Record]
    history: list[int] = msgspec.field(default_factory=list)
    done: bool = False  # the last batch: the segment takes placements again


class PingReq(msgspec.Struct):
    client_id: str
    fenced: list[int] = msgspec.field(default_factory=list)  # generations this client's segments fenced
    suspects: list[str] = msgspec.field(default_factory=list)  # segments a transfer to failed
    forgot: list[int] = msgspec.field(default_factory=list)  # generations whose headers went
    retired: list[tuple[str, int]] = msgspec.field(default_factory=list)  # see PutStartReq


class RepairTask(msgspec.Struct, array_like=True):
    """Copy one object from ``sources`` into this client's segment at ``addr`` (allocation ``gen``)."""

    key: str
    version: int
    gen: int
    addr: int
    size: int
    checksum: int
    sources: list[Replica]
    header: bytes = b""  # the inventory header to write in front of ``addr`` once verified


class PingRep(msgspec.Struct):
    status: str  # "ok" | "need_remount"
    view_version: int
    fences: list[int] = msgspec.field(default_factory=list)  # fence these, then acknowledge
    repairs: list[RepairTask] = msgspec.field(default_factory=list)
    forgets: list[tuple[int, int]] = msgspec.field(default_factory=list)  # (gen, header address)


class RepairDoneReq(msgspec.Struct):
    client_id: str
    keys: list[str]
    gens: list[int]
    ok: list[bool]


class PutStartReq(msgspec.Struct):
    client_id: str
    keys: list[str]
    sizes: list[int]
    config: ReplicateConfig
    upsert: bool = False
    ttl: float = 0.0  # seconds this client may go on writing (its call deadline); 0: the default
    checksums: list[int] = msgspec.field(default_factory=list)  # of each value (the headers carry it)
    nonce: int = 0  # this call's id: a retry with the same nonce resumes its puts
    # (segment, generation) this client had refused there (``Retire``) since it last said:
    # that space may go to new objects before its lease ends (``Quarantine.ack``)
    retired: list[tuple[str, int]] = msgspec.field(default_factory=list)
    returns: list[tuple[str, int, bool]] = msgspec.field(default_factory=list)  # as PutEndReq's


class KeyResult(msgspec.Struct, array_like=True, gc=False):
    """Per-key outcome: code 0 and replicas, or a negative error code."""

    code: int
    replicas: list[Replica] = msgspec.field(default_factory=list)
    size: int = 0
    version: int = 0  # the object's version (the generation of the put that made it)
    checksum: int = 0  # of the object's bytes (0: none recorded)
    header: bytes = b""  # PutStart: the inventory header to write in front of every replica
    disk: list[DiskReplica] = msgspec.field(default_factory=list)  # SSD copies (read-through)


class Location(NamedTuple):
    """Where a client last read a key (``kvplane.store.client.location_cache``); a tuple on the
    wire (``KeysReq.expect``)."""

    segment: str
    addr: int  # of the value
    gen: int
    size: int


# (segment, grant): a tenant's grant (``kvplane.transfer.grants``) for one replica, to install
# at that segment's listener before reading, writing or retiring there
Grant = tuple[str, bytes]


# (key index, segment, generation): a replica of an object that this call replaced or removed
# while a read lease on it was running. Clients that hold that lease may read the replica
# without asking the master (``kvplane.store.client.get_path``), so the caller has the
# segment refuse the generation (``TransferEngine.retire``) before its call returns.
Retire = tuple[int, str, int]


class KeysReq(msgspec.Struct):
    client_id: str
    keys: list[str]
    suspects: list[str] = msgspec.field(default_factory=list)  # segments a transfer to failed
    # get_replicas only: per key the location the client read it from meanwhile (None: not
    # read). A key whose object still has a replica there is answered by its absence from
    # ``ResultsRep.stale``, with the same lease, instead of by its replicas.
    expect: list[Location | None] | None = None
    # get_replicas: the client takes ``ResultsRep.columns`` when every key has one plain
    # replica (checksums off: the columns carry none); exist: the answer names, in
    # ``CodesRep.columns``, the places of the keys under the read lease exist grants, when
    # every key is such an object (the caller then holds them: its gets read there at once)
    columns: bool = False


class SpareAsk(msgspec.Struct, array_like=True):
    """A PutEnd's ask for a spare: an allocation, made now, for this client's next put of one
    ``size``-byte object whose header is ``hdr`` bytes, placed by ``config``."""

    size: int
    hdr: int
    config: ReplicateConfig


class Spare(msgspec.Struct, array_like=True):
    """An allocation granted ahead for a client's next put (``kvplane.store.client.spares``).

    The client writes the header (which it builds, keyed by ``secret``) and the value into
    ``result``'s replicas, then commits them under the put's key with one PutEnd (``renames``):
    a put of two round trips instead of three. Until then it is an unfinished put under
    ``name``, a name no user key can have, fenced and freed as any other.
    """

    name: str
    result: KeyResult  # code 0, the replicas, size and version (the generation to write)
    window: float  # seconds from the request in which the client may begin writing
    secret: bytes  # keys the inventory headers' tags (``inventory.secret_of``)


class PutEndReq(msgspec.Struct):
    """PutEnd / PutRevoke: each key with the version PutStart gave it (and, for PutEnd, the
    checksum of its bytes).

    PutEnd only: ``renames``, per key, the name of the spare whose replicas it was written
    into (the spare becomes that key); ``spare``, allocate the next spare and send it back
    (``CodesRep.spare``); ``returns``, spares (name, version, written into) the client gives
    back: one never written is freed at once, one written into (a failed write) is revoked.
    """

    client_id: str
    keys: list[str]
    versions: list[int]
    checksums: list[int] = msgspec.field(default_factory=list)
    suspects: list[str] = msgspec.field(default_factory=list)
    renames: list[str] = msgspec.field(default_factory=list)
    spare: SpareAsk | None = None
    returns: list[tuple[str, int, bool]] = msgspec.field(default_factory=list)


class RemoveReq(msgspec.Struct):
    client_id: str
    keys: list[str]
    force: bool = False


class RegexReq(msgspec.Struct):
    client_id: str
    pattern: str
    force: bool = False


class ListKeysReq(msgspec.Struct):
    """One page of the caller's complete keys that start with ``prefix``, in ascending order.

    ``limit``: at most this many keys (0: as many as one answer carries, ``MAX_LIST_KEYS``);
    ``after``: only keys greater than this one (the last key of the previous page; None: from
    the first)."""

    client_id: str
    prefix: str = ""
    limit: int = 0
    after: str | None = None


class ListKeysRep(msgspec.Struct):
    """``more``: keys past this page match too (ask again with ``after=keys[-1]``)."""

    keys: list[str]
    more: bool = False


class Columns(msgspec.Struct, array_like=True, gc=False):
    """A lookup's answer when every key was found with one memory replica (and no copy on
    disk), a list per field: key ``i`` is at ``addr[i]`` (its value's address) in segment
    ``segments[seg[i]]``, ``size[i]`` bytes, allocation generation ``gen[i]``. Decoding it
    creates a few lists of ints where a list of ``KeyResult`` makes four objects and three
    strings per key."""

    segments: list[str]
    seg: list[int]
    addr: list[int]
    size: list[int]
    gen: list[int]


class ResultsRep(msgspec.Struct):
    results: list[KeyResult]
    ttl: float = 0.0  # seconds the replicas stay valid from the master's receipt (lease or write window)
    retry_after: float = 0.0  # PutStart: room is being made (offloads to disk); retry the
    # NoAvailableHandle keys after this many seconds, within the call's deadline
    stale: list[int] | None = None  # get_replicas with ``expect``: the keys (by index) that
    # ``results`` answer, in order; every other key is where the client expected it
    columns: Columns | None = None  # get_replicas with ``columns``: the whole answer, when
    # every key is plain (``results`` is then empty)
    retire: list[Retire] | None = None  # PutStart: what the caller retires before PutEnd
    grants: list[Grant] | None = None  # to a tenant: its grants for the replicas (and retires)


class CodesRep(msgspec.Struct):
    codes: list[int]
    retire: list[Retire] | None = None  # remove: what the caller retires before it returns
    spare: Spare | None = None  # PutEnd: the spare asked for (None: none could be made)
    grants: list[Grant] | None = None  # remove, to a tenant: its grants for ``retire``
    # exist with ``KeysReq.columns``, every key found plain: their places, read-leased for
    # ``ttl`` seconds from the master's receipt (as a lookup's answer)
    columns: Columns | None = None
    ttl: float = 0.0


def column_results(cols: Columns) -> list[KeyResult]:
    """:class:`Columns` as the ``KeyResult`` list of a read (without the replicas' endpoint
    and host, the object's version and checksum, which a read of one replica does not use)."""
    names = cols.segments
    return [KeyResult(0, [Replica(names[s], a, n, "", "", g)], n)
            for s, a, n, g in zip(cols.seg, cols.addr, cols.size, cols.gen)]
