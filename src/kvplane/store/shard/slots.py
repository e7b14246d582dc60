"""Hash slots and the shard map: which master shard owns which key.

The key space is cut into ``SLOTS`` fixed hash slots (Redis Cluster's scheme): a key's slot is
the CRC-32 of the key, or of its hash tag (the text between the first ``{`` and the next ``}``,
when not empty: ``{req-17}/layer-3`` and ``{req-17}/layer-4`` land in one slot), modulo
``SLOTS``. A :class:`ShardMap` gives each slot an owner shard, carries a version that only
grows, and lists the slot ranges being moved from one shard to another (``moving``).

Why fixed slots and not consistent hashing: a move is explicit (these slots, from that shard to
this one), so the shards can refuse and redirect exactly the keys in transit and a client can
tell a stale map by its version; the map is a few runs of slots, and a lookup is one CRC and
one index. Consistent hashing moves implicit key ranges whenever the ring changes and needs
virtual nodes to balance, which makes "who owns this key right now" a question of which ring
each party has seen.

Pure: no I/O, no clock, no threads. Imports msgspec and zlib only.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import msgspec

from kvplane.common.errors import InvalidArgument

SLOTS = 16384
MAX_SHARDS = 64  # a segment's fence keeps one floor per shard (``kvplane.transfer.fence``)
SEP = "\x00"  # the master's tenant-scoped keys are "\0tenant\0key" (``master.access.scoped``)

# What a shard does with a key of a slot, by its role in the map (``SlotTable.state``)
OTHER = 0  # another shard owns it: redirect (WrongShard)
OWN = 1  # this shard owns it and serves it
OUT = 2  # moving out of this shard: reads and the end of open puts only
IN = 3  # moving into this shard: not served until the move ends (SlotMoving)


def slot_of(key: str) -> int:
    """The hash slot of a user key (its hash tag's, when it has one)."""
    i = key.find("{")
    if i >= 0:
        j = key.find("}", i + 1)
        if j > i + 1:
            key = key[i + 1:j]
    return zlib.crc32(key.encode()) & (SLOTS - 1)


def slot_of_internal(key: str) -> int:
    """The hash slot of a key as the master stores it (a tenant's ``\\0T\\0k`` hashes as ``k``)."""
    if key.startswith(SEP):
        key = key.split(SEP, 2)[2]
    return slot_of(key)


class ShardInfo(msgspec.Struct, array_like=True, frozen=True):
    """One shard: its id, where clients reach its master, and its admin HTTP (``/status``)."""

    id: int
    address: str  # master RPC: HOST:PORT, or etcd://h1:2379;h2:2379/CLUSTER (HA)
    admin: str = ""  # admin HTTP HOST:PORT ("" when unknown)


class Move(msgspec.Struct, array_like=True, frozen=True):
    """Slots ``[first, end)`` in transit from shard ``source`` (which still owns them in the
    map's runs) to shard ``target``."""

    first: int
    end: int
    source: int
    target: int


class ShardMap(msgspec.Struct, frozen=True):
    """Owner of every slot, as runs: ``runs[i] = (first slot, shard id)`` holds from its first
    slot to the next run's (the last run to ``SLOTS``). ``version`` grows with every change."""

    version: int
    shards: list[ShardInfo]
    runs: list[tuple[int, int]]
    moving: list[Move] = msgspec.field(default_factory=list)

    def shard(self, shard_id: int) -> ShardInfo:
        """The shard ``shard_id``.

        Raises:
            InvalidArgument: the map has no such shard.
        """
        for s in self.shards:
            if s.id == shard_id:
                return s
        raise InvalidArgument(f"shard map v{self.version} has no shard {shard_id}")

    def ids(self) -> list[int]:
        """Shard ids, ascending."""
        return sorted(s.id for s in self.shards)


def check(m: ShardMap) -> ShardMap:
    """Validate a map (runs ascending from slot 0, owners and moves among its shards).

    Raises:
        InvalidArgument: what is wrong with it.
    """
    ids = {s.id for s in m.shards}
    if len(ids) != len(m.shards) or not ids or max(ids) >= MAX_SHARDS or min(ids) < 0:
        raise InvalidArgument(f"shard ids must be distinct, 0..{MAX_SHARDS - 1}")
    if not m.runs or m.runs[0][0] != 0:
        raise InvalidArgument("slot runs must start at slot 0")
    for (a, _), (b, _) in zip(m.runs, m.runs[1:]):
        if not a < b < SLOTS:
            raise InvalidArgument("slot runs must ascend within the slots")
    if any(s not in ids for _, s in m.runs):
        raise InvalidArgument("a slot run names a shard the map does not list")
    for mv in m.moving:
        if not (0 <= mv.first < mv.end <= SLOTS) or {mv.source, mv.target} - ids \
                or mv.source == mv.target:
            raise InvalidArgument(f"bad move {mv}")
    return m


def even(shards: list[ShardInfo], version: int = 1) -> ShardMap:
    """A map giving each shard an equal run of slots, in id order."""
    order = sorted(shards, key=lambda s: s.id)
    n = len(order)
    runs = [(i * SLOTS // n, s.id) for i, s in enumerate(order)]
    return check(ShardMap(version, order, runs))


def owners(m: ShardMap) -> bytearray:
    """The owner shard of every slot (index: slot)."""
    out = bytearray(SLOTS)
    bounds = [first for first, _ in m.runs[1:]] + [SLOTS]
    for (first, sid), end in zip(m.runs, bounds):
        out[first:end] = bytes([sid]) * (end - first)
    return out


def runs_of(owner: bytearray) -> list[tuple[int, int]]:
    """The runs of an owner table (the inverse of :func:`owners`)."""
    runs: list[tuple[int, int]] = []
    for slot, sid in enumerate(owner):
        if not runs or runs[-1][1] != sid:
            runs.append((slot, sid))
    return runs


def reassign(m: ShardMap, slots: Iterable[int], target: int, shards: list[ShardInfo] | None = None,
             moving: list[Move] | None = None) -> ShardMap:
    """A new version of ``m`` with ``slots`` owned by ``target`` (``shards``, ``moving``:
    replace the map's).

    Raises:
        InvalidArgument: ``m`` or the result is malformed (``check``).
    """
    owner = owners(check(m))
    for s in slots:
        owner[s] = target
    return check(ShardMap(m.version + 1, list(m.shards if shards is None else shards),
                          runs_of(owner), list(m.moving if moving is None else moving)))


def ranges(slots: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted slots as ``[first, end)`` ranges."""
    out: list[tuple[int, int]] = []
    for s in sorted(slots):
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], s + 1)
        else:
            out.append((s, s + 1))
    return out


class SlotTable:
    """What one shard does with each slot under a map (``state[slot]``: OTHER, OWN, OUT, IN).

    Args:
        m: the map.
        me: this shard's id.
    """

    __slots__ = ("map", "me", "owner", "state")

    def __init__(self, m: ShardMap, me: int) -> None:
        self.map, self.me = m, me
        self.owner = owners(m)
        self.state = bytearray(OWN if o == me else OTHER for o in self.owner)
        for mv in m.moving:
            if mv.source == me:
                self.state[mv.first:mv.end] = bytes([OUT]) * (mv.end - mv.first)
            elif mv.target == me:
                self.state[mv.first:mv.end] = bytes([IN]) * (mv.end - mv.first)

    def slots(self, state: int) -> list[int]:
        """The slots in ``state``."""
        return [i for i, s in enumerate(self.state) if s == state]
