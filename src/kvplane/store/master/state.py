"""MasterState: the store's metadata state machine. Pure: no I/O, no threads, no clock reads.

Every method takes ``now`` (seconds, monotonic) from the caller, so tests replay any timeline.
Holds segments (with their allocators), clients (with heartbeats), and objects (with replicas,
leases, pins and LRU order). Replicas of one object sit on distinct segments. The caller
serialises access (one lock in the server).

Integrity: every allocation gets a generation (``epoch << EPOCH_SHIFT | counter``) that data
frames carry; freed space goes through a ``Quarantine`` (leases, write windows, segment fences)
before reuse; a segment a client reported failing is suspected (no placement, read last) until
its owner heartbeats again; objects short of their replicas are re-replicated (``repair.py``).

Inventory (issue 10): every allocation is ``[header][value]``; the header (built here, written
by the client with the value) lets a segment re-register what it holds with a master that does
not know it (``adopt.py``). A master that is recovering (a new leader, or a restart that
segments reported) answers misses with ``Recovering`` until the segments it waits for have
re-registered, or its grace ends (``recovering``).
"""

from __future__ import annotations

import random
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from kvplane.common.errors import InvalidArgument, KVPlaneError
from kvplane.store import inventory
from kvplane.store.errors import (
    InvalidKey, InvalidParams, NoAvailableHandle, ObjectExists, ObjectHasLease, ObjectNotFound,
    ReplicaNotReady, SegmentExists, SegmentNotFound, ValueTooLarge,
)
from kvplane.store.master.adopt import Adoption
from kvplane.store.master.allocator import OffsetAllocator
from kvplane.store.master.config import MasterConfig
from kvplane.store.master.fences import Quarantine
from kvplane.store.master.repair import Repairs
from kvplane.store.master.tiers import DiskTier
from kvplane.store.types import (
    MAX_KEY, MAX_VALUE, Columns, KeyResult, Location, Replica, ReplicateConfig, SegmentInfo,
)
from kvplane.transfer.fence import EPOCH_SHIFT

Rep = tuple[str, int, int]  # (segment, offset, generation)


@dataclass
class Segment:
    info: SegmentInfo
    alloc: OffsetAllocator
    suspect_since: float | None = None  # a client reported a failed transfer to it
    adopting: bool = False  # re-registering what it holds: no new placements yet

    def replica(self, off: int, size: int, gen: int = 0, hdr: int = 0) -> Replica:
        """The replica whose allocation starts at ``off``: its value follows the header."""
        return Replica(self.info.name, self.info.base + off + hdr, size, self.info.endpoint,
                       self.info.host_id, gen)


class Obj(msgspec.Struct, gc=False):
    """One object's metadata. Not tracked by Python's cyclic GC (it holds no cycle, and its
    replicas are a tuple): a full collection in a master holding millions of objects would
    otherwise walk every one of them, under the lock every RPC takes."""

    size: int
    replicas: tuple[Rep, ...]
    complete: bool
    started: float
    lease_until: float = 0.0
    hard_pin: bool = False
    soft_pin_until: float = 0.0
    soft_pin_ttl: float = 0.0
    version: int = 0  # generation of the put that made it
    checksum: int = 0
    want: int = 1  # replicas asked for
    writer: str = ""  # client id of the put
    window_until: float = 0.0  # the writer may copy into its replicas until then
    owner: str = ""  # client id of the put that made it (Mooncake's metadata.client_id)
    hdr: int = 0  # bytes of the inventory header in front of the value in every replica
    header: bytes = b""  # that header, while the put is unfinished
    flags: int = 0  # inventory flags (hard pin)
    nonce: int = 0  # id of the PutStart call that made it (a retry of it resumes the put)
    disk: dict[str, str] = msgspec.field(default_factory=dict)  # SSD copies: segment -> path

    def replicas_of(self, segments: dict[str, "Segment"], reps: Sequence[Rep] | None = None
                    ) -> list[Replica]:
        return [segments[s].replica(o, self.size, g, self.hdr) for s, o, g in
                (self.replicas if reps is None else reps)]


@dataclass
class Client:
    last_seen: float
    segments: set[str] = field(default_factory=set)


class MasterState:
    """All store metadata. See the module docstring for the threading and clock contract."""

    def __init__(self, config: MasterConfig | None = None, seed: int = 0, epoch: int = 1) -> None:
        self.config = config or MasterConfig()
        self.rng = random.Random(seed)
        self.epoch = epoch
        self.secret = b""  # keys the inventory headers' tags (``inventory.secret_of``)
        self._next_gen = epoch << EPOCH_SHIFT
        self.objects: OrderedDict[str, Obj] = OrderedDict()  # LRU order: oldest first
        # puts started and not ended (entries of ended or dropped ones are pruned by
        # ``reclaim``): the timer looks at these, never at every object
        self.open_puts: dict[str, Obj] = {}
        self.segments: dict[str, Segment] = {}
        self.clients: dict[str, Client] = {}
        self.graveyard = Quarantine()  # freed space not yet reusable
        self.repairs = Repairs(self)
        self.adoption = Adoption(self)
        self.tiers = DiskTier(self)
        self.gate_until = 0.0  # recovering until then ...
        self.awaiting: set[str] | None = None  # ... or until these segments re-registered
        self.view_version = 1
        self.evicted = 0
        self.alloc_failures = 0
        self.largest = 0  # bytes of the largest segment mounted (0: none)
        self.puts = 0  # objects committed (PutEnd or a spare's commit; once each)
        self.changes: list[tuple[str, str]] = []  # ("stored"|"removed", key), drained by the server
        # (segment, generation, lease end) of leased objects dropped since the server last
        # took them: the caller retires them at their segments (held reads, ``_drop``)
        self.retiring: list[tuple[str, int, float]] = []

    # -- clients and segments ----------------------------------------------------------------
    def mount(self, client_id: str, segs: list[SegmentInfo], now: float,
              adopt: bool = False) -> int:
        """Register a client's segments (a remount of its own segments is accepted).

        ``adopt``: the client will re-register the records its segments hold; they take no new
        placements until it says it is done (``adopted``).

        Returns:
            The floor: the lowest generation this master can issue from now on (the segments
            refuse frames of older ones, see ``kvplane.transfer.fence``).

        Raises:
            SegmentExists: the name belongs to another client.
        """
        client = self.clients.setdefault(client_id, Client(now))
        client.last_seen = now
        for info in segs:
            if info.size <= 0:
                raise InvalidArgument(f"segment {info.name!r} has size {info.size}")
            old = self.segments.get(info.name)
            if old is not None:
                if old.info.client_id != client_id:
                    raise SegmentExists(f"segment {info.name!r} is mounted by another client")
                continue
            info.client_id = client_id
            self.segments[info.name] = Segment(info, OffsetAllocator(info.size), adopting=adopt)
            client.segments.add(info.name)
            self.largest = max(self.largest, info.size)
        return self._next_gen + 1

    def adopt(self, client_id: str, name: str, records: list[inventory.Record],
              history: list[int], done: bool, now: float) -> list[int]:
        """Re-register objects segment ``name`` holds (see ``adopt.py``); per record its new
        generation or 0 (refused). ``done``: the segment has sent everything.

        Raises:
            SegmentNotFound: ``name`` is not a segment of ``client_id``.
        """
        seg = self.segments.get(name)
        if seg is None or seg.info.client_id != client_id:
            raise SegmentNotFound(f"segment {name!r} is not mounted by this client")
        client = self.clients.get(client_id)
        if client is not None:
            client.last_seen = now
        gens = self.adoption.adopt(seg, records, history, now)
        if done:
            seg.adopting = False
            if self.awaiting is not None:
                self.awaiting.discard(name)
        return gens

    def adopted_object(self, rec: inventory.Record, segment: str, gen: int, hard_pin: bool) -> None:
        """A complete object re-registered from a segment's record (``adopt.py``)."""
        self.objects[rec.key] = Obj(rec.size, ((segment, rec.offset, gen),), True, 0.0,
                                    hard_pin=hard_pin, version=rec.version, checksum=rec.checksum,
                                    want=rec.want, hdr=rec.hdr, flags=rec.flags)
        self.changes.append(("stored", rec.key))
        if rec.want > 1:
            self.repairs.short.add(rec.key)

    def disk_object(self, rec: inventory.Record, segment: str, path: str) -> None:
        """A complete object re-registered from a node's disk copy (``tiers.py``): no memory
        replica until a read promotes it."""
        self.objects[rec.key] = Obj(rec.size, (), True, 0.0,
                                    hard_pin=bool(rec.flags & inventory.FLAG_HARD_PIN),
                                    version=rec.version, checksum=rec.checksum, want=rec.want,
                                    hdr=rec.hdr, flags=rec.flags, disk={segment: path})
        self.changes.append(("stored", rec.key))

    def recover(self, now: float, grace: float, awaiting: set[str] | None) -> None:
        """Answer misses with ``Recovering`` for up to ``grace`` seconds, or until every segment
        in ``awaiting`` (None: unknown) has re-registered."""
        self.gate_until = now + grace
        self.awaiting = None if awaiting is None else set(awaiting)

    def recovering(self, now: float) -> bool:
        """True while misses may still be objects that segments have not re-registered."""
        return now < self.gate_until and (self.awaiting is None or bool(self.awaiting))

    def unmount(self, name: str) -> int:
        """Drop a segment and every replica on it; returns objects lost entirely."""
        seg = self.segments.pop(name, None)
        if seg is None:
            return 0
        client = self.clients.get(seg.info.client_id)
        if client:
            client.segments.discard(name)
        self.largest = max((s.alloc.capacity for s in self.segments.values()), default=0)
        self.graveyard.drop_segment(name)
        self.repairs.drop_segment(name)
        self.adoption.drop_segment(name)
        if self.awaiting is not None:
            self.awaiting.discard(name)
        lost = 0
        for key in self.tiers.drop_segment(name):
            obj = self.objects.pop(key)
            self.repairs.forget(key, 0.0)
            self.changes.append(("removed", key))
            lost += 1
        for key in list(self.objects):
            obj = self.objects[key]
            keep = [r for r in obj.replicas if r[0] != name]
            if len(keep) != len(obj.replicas):
                obj.replicas = tuple(keep)
                if not keep and not obj.disk:
                    del self.objects[key]
                    if obj.complete:
                        self.changes.append(("removed", key))
                    lost += 1
                elif obj.complete and keep:
                    self.repairs.short.add(key)
        return lost

    def ping(self, client_id: str, now: float, fenced: list[int] | None = None,
             forgot: list[int] | None = None) -> str:
        """Heartbeat: "ok", or "need_remount" for a client this master does not know.

        ``fenced``: generations the client's segments have fenced (acknowledgements). A heartbeat
        clears a suspicion older than ``suspect_min`` on the client's segments.
        """
        client = self.clients.get(client_id)
        if client is None:
            return "need_remount"
        client.last_seen = now
        if forgot:
            self.adoption.forgot(client.segments, forgot)
        for name in client.segments:
            if fenced:
                self.graveyard.ack(name, fenced)
            seg = self.segments.get(name)
            if seg is not None and seg.suspect_since is not None and \
                    now - seg.suspect_since >= self.config.suspect_min:
                seg.suspect_since = None
        return "ok"

    def retired(self, pairs: list[tuple[str, int]]) -> int:
        """A client had these (segment, generation) refused at their segments (``Retire``):
        their space, held for readers, may go early when the pool is full. Returns how many
        holds that cleared. (A client with the pool token could write that space directly, so
        believing it grants nothing new.)"""
        by_seg: dict[str, list[int]] = {}
        for seg, gen in pairs:
            by_seg.setdefault(seg, []).append(gen)
        return sum(self.graveyard.ack(seg, gens) for seg, gens in by_seg.items())

    def forgets_for(self, client_id: str) -> list[tuple[int, int]]:
        """(generation, header address) of freed allocations whose headers the segments of
        ``client_id`` must clear."""
        client = self.clients.get(client_id)
        return self.adoption.forgets_for(client.segments) if client is not None else []

    def fences_for(self, client_id: str) -> list[int]:
        """Generations the segments of ``client_id`` must fence before their space is reused."""
        client = self.clients.get(client_id)
        if client is None:
            return []
        return [g for name in sorted(client.segments) for g in self.graveyard.to_fence(name)]

    def suspect(self, names: list[str], now: float) -> None:
        """A client failed to transfer to these segments: place nothing there, read them last."""
        for name in names:
            seg = self.segments.get(name)
            if seg is not None:
                seg.suspect_since = now

    def _gen(self) -> int:
        self._next_gen += 1
        return self._next_gen

    def expire_clients(self, now: float) -> list[str]:
        """Unmount the segments of clients silent for longer than the TTL."""
        dead = [cid for cid, c in self.clients.items()
                if now - c.last_seen > self.config.client_ttl]
        for cid in dead:
            for name in list(self.clients[cid].segments):
                self.unmount(name)
            del self.clients[cid]
        if dead:  # their unfinished puts will never end: fence and free them
            gone = set(dead)
            for key in [k for k, o in self.objects.items() if not o.complete and o.writer in gone]:
                self._drop(key, self.objects[key], now)
        return dead

    # -- writes ----------------------------------------------------------------------------------
    def put_start(self, key: str, size: int, cfg: ReplicateConfig, now: float,
                  upsert: bool = False, local_segments: frozenset[str] = frozenset(),
                  client_id: str = "", window: float = 0.0, checksum: int = 0,
                  nonce: int = 0) -> KeyResult:
        """Allocate replicas for a new object; it stays invisible until put_end.

        ``window``: seconds the writer may copy (its deadline); its space is not reused before
        the window is over, even if the put is pre-empted. 0 means ``config.write_window``.
        ``checksum``: of the value (the inventory header carries it). The result carries the
        header the writer copies in front of the value of every replica. ``nonce``: the call's
        own id; the same writer asking again with the same nonce (its first answer was lost)
        gets the same allocations back.

        Returns a KeyResult with code 0, the replicas and the object's version, or a negative
        error code.
        """
        try:
            self._check_key(key)
            if not 0 < size <= MAX_VALUE:
                raise InvalidParams(f"object size {size} out of range")
            if cfg.replica_num < 1:
                raise InvalidParams("replica_num must be >= 1")
            pin = self._soft_pin_ttl(cfg)
            hdr = inventory.header_len(key)
            if self.largest and hdr + size > self.largest:  # no eviction can ever make room
                return KeyResult(ValueTooLarge.code, size=self.largest)
            old = self.objects.get(key)
            kept_pin = old.soft_pin_until if old is not None and old.complete else 0.0
            if old is not None:
                if old.complete and not upsert:
                    raise ObjectExists(f"{key!r} exists")
                if not old.complete and nonce and old.nonce == nonce and old.writer == client_id:
                    return self._resume(key, old, now, window)  # a retried PutStart
                if not old.complete and now - old.started < self.config.put_discard_timeout:
                    raise ObjectExists(f"{key!r} is being written")
                self._drop(key, old, now)
            elif len(self.objects) >= self.config.max_keys:
                raise NoAvailableHandle("the master holds its maximum number of keys")
            replicas = self._place(hdr + size, cfg, now, local_segments)
        except KVPlaneError as exc:
            return KeyResult(exc.code)
        flags = inventory.FLAG_HARD_PIN if cfg.with_hard_pin else 0
        version = replicas[0][2]
        obj = Obj(size, tuple(replicas), False, now, hard_pin=cfg.with_hard_pin, version=version,
                  want=cfg.replica_num, writer=client_id, checksum=checksum, nonce=nonce,
                  window_until=now + self.write_window(window), hdr=hdr, flags=flags,
                  soft_pin_ttl=pin,
                  soft_pin_until=kept_pin if cfg.pin_action() == "preserve" else 0.0,
                  header=inventory.pack(self.secret, key, version, version, size, checksum,
                                        cfg.replica_num, flags))
        self.objects[key] = obj
        self.open_puts[key] = obj
        return KeyResult(0, obj.replicas_of(self.segments), size, obj.version, checksum, obj.header)

    def _resume(self, key: str, obj: Obj, now: float, window: float) -> KeyResult:
        """The same writer asks again for its unfinished put (its first answer was lost):
        the same allocations, with a fresh write window."""
        obj.window_until = max(obj.window_until, now + self.write_window(window))
        return KeyResult(0, obj.replicas_of(self.segments), obj.size, obj.version, obj.checksum,
                         obj.header)

    def write_window(self, asked: float) -> float:
        """The write window granted for a client's ``asked`` seconds (0: the default)."""
        return min(asked or self.config.write_window, self.config.put_discard_timeout)

    def put_end(self, key: str, now: float, version: int = 0, checksum: int = 0) -> int:
        """Make a written object visible (0, or an error code).

        ``version``: the one PutStart gave (0: not checked). A put that was pre-empted, revoked
        or lost with its segments gets ObjectNotFound: it was not committed.
        """
        obj = self.objects.get(key)
        if obj is None or (version and obj.version != version):
            return ObjectNotFound.code
        if not obj.complete:
            obj.complete = True
            self.puts += 1
            self.open_puts.pop(key, None)
            obj.checksum = obj.checksum or checksum
            obj.writer, obj.header = "", b""
            self.changes.append(("stored", key))
            if obj.soft_pin_ttl:
                obj.soft_pin_until = now + obj.soft_pin_ttl
            self.objects.move_to_end(key)
            if len(obj.replicas) < obj.want:
                self.repairs.short.add(key)
            self.tiers.stored(key, obj)
        return 0

    def put_revoke(self, key: str, now: float, version: int = 0) -> int:
        """Abandon an unfinished put. Its space is fenced on its segments before reuse."""
        obj = self.objects.get(key)
        if obj is None or obj.complete or (version and obj.version != version):
            return ObjectNotFound.code
        obj.window_until = now  # the writer's own copies are over; only frames may be in flight
        self._drop(key, obj, now)
        return 0

    # -- reads -----------------------------------------------------------------------------------
    def get_replicas(self, key: str, now: float) -> KeyResult:
        """Replicas of a complete object; grants a read lease and refreshes its LRU position."""
        obj = self.objects.get(key)
        if obj is None:
            return KeyResult(ObjectNotFound.code)
        if not obj.complete:
            return KeyResult(ReplicaNotReady.code)
        obj.lease_until = max(obj.lease_until, now + self.config.lease_ttl)
        self.objects.move_to_end(key)
        reps = obj.replicas
        if len(reps) > 1 and any(self.segments[r[0]].suspect_since is not None for r in reps):
            reps = sorted(reps, key=lambda r: self.segments[r[0]].suspect_since is not None)
        return KeyResult(0, obj.replicas_of(self.segments, reps), obj.size, obj.version,
                         obj.checksum, disk=self.tiers.disk_replicas(key, obj) if obj.disk else [])

    def get_replicas_many(self, keys: list[str], now: float) -> list[KeyResult]:
        """:meth:`get_replicas` of each key (the same leases and LRU moves), with the common
        case inlined: one replica, no SSD copy."""
        objects, segments = self.objects, self.segments
        until = now + self.config.lease_ttl
        touch = objects.move_to_end
        out: list[KeyResult] = []
        for key in keys:
            obj = objects.get(key)
            if obj is None or not obj.complete or obj.disk or len(obj.replicas) != 1:
                out.append(self.get_replicas(key, now))
                continue
            if obj.lease_until < until:
                obj.lease_until = until
            touch(key)
            name, off, gen = obj.replicas[0]
            out.append(KeyResult(0, [segments[name].replica(off, obj.size, gen, obj.hdr)],
                                 obj.size, obj.version, obj.checksum))
        return out

    def columns_many(self, keys: list[str], now: float) -> Columns | None:
        """:meth:`get_replicas_many` as :class:`Columns`, with the same leases and LRU moves,
        when every key is a complete object with one replica and no copy on disk; else None
        (the leases and moves already given are those :meth:`get_replicas_many` gives
        again)."""
        objects, segments = self.objects, self.segments
        until = now + self.config.lease_ttl
        touch = objects.move_to_end
        names: dict[str, int] = {}
        seg: list[int] = []
        addr: list[int] = []
        size: list[int] = []
        gen: list[int] = []
        for key in keys:
            obj = objects.get(key)
            if obj is None or not obj.complete or obj.disk or len(obj.replicas) != 1:
                return None
            if obj.lease_until < until:
                obj.lease_until = until
            touch(key)
            name, off, g = obj.replicas[0]
            j = names.get(name)
            if j is None:
                j = names[name] = len(names)
            seg.append(j)
            addr.append(segments[name].info.base + off + obj.hdr)
            size.append(obj.size)
            gen.append(g)
        return Columns(list(names), seg, addr, size, gen)

    def confirm_many(self, keys: list[str], expect: list[Location | None], now: float
                     ) -> tuple[list[int], list[KeyResult]]:
        """:meth:`get_replicas_many` for a client that read each key from ``expect`` meanwhile:
        a key whose complete object still has a replica at that location (segment, value
        address, generation, size) gets its lease and LRU move and no answer; the others are
        returned as (their indexes, their :meth:`get_replicas`)."""
        objects, segments = self.objects, self.segments
        until = now + self.config.lease_ttl
        touch = objects.move_to_end
        stale: list[int] = []
        out: list[KeyResult] = []
        for i, (key, loc) in enumerate(zip(keys, expect, strict=True)):
            obj = objects.get(key)
            if loc is not None and obj is not None and obj.complete and obj.size == loc[3] and any(
                    g == loc[2] and name == loc[0] and segments[name].info.base + off + obj.hdr == loc[1]
                    for name, off, g in obj.replicas):
                if obj.lease_until < until:
                    obj.lease_until = until
                touch(key)
                continue
            stale.append(i)
            out.append(self.get_replicas(key, now))
        return stale, out

    def exist(self, key: str, now: float) -> int:
        """1 if a complete object exists (and lease it, as Mooncake's ExistKey does), else 0."""
        obj = self.objects.get(key)
        if obj is None or not obj.complete:
            return 0
        obj.lease_until = max(obj.lease_until, now + self.config.lease_ttl)
        return 1

    # -- removal ---------------------------------------------------------------------------------
    def remove(self, key: str, force: bool, now: float) -> int:
        """Remove one object: 0, -704 missing, -706 leased (unless ``force``)."""
        obj = self.objects.get(key)
        if obj is None:
            return ObjectNotFound.code
        if not force and obj.lease_until > now:
            return ObjectHasLease.code
        if not force and not obj.complete:
            return ReplicaNotReady.code
        self._drop(key, obj, now)
        return 0

    def remove_regex(self, pattern: str, force: bool, now: float) -> int:
        """Remove every removable key matching ``pattern``; returns the count."""
        try:
            rx = re.compile(pattern)
        except re.error as exc:
            raise InvalidArgument(f"bad regex {pattern!r}: {exc}") from exc
        return sum(1 for k in list(self.objects)
                   if rx.search(k) and self.remove(k, force, now) == 0)

    def remove_all(self, force: bool, now: float) -> int:
        """Remove every removable object (leased ones are skipped unless ``force``)."""
        return sum(1 for k in list(self.objects) if self.remove(k, force, now) == 0)

    # -- background passes (the server calls these on a timer) -----------------------------------
    def reclaim(self, now: float) -> int:
        """Free quarantined space that is due and puts abandoned past the release timeout."""
        self.retiring.clear()  # no caller to hand them to (their fences go by heartbeat)
        due = self.graveyard.due(now)
        for seg, off in due:
            if seg in self.segments:
                self.segments[seg].alloc.free(off)
        stale = []
        for k, o in list(self.open_puts.items()):
            if self.objects.get(k) is not o or o.complete:  # ended, revoked or dropped
                del self.open_puts[k]
            elif now - o.started > self.config.put_release_timeout:
                stale.append(k)
        for k in stale:
            self._drop(k, self.open_puts.pop(k), now)
        return len(due) + len(stale)

    def used_ratio(self) -> float:
        cap = sum(s.alloc.capacity for s in self.segments.values())
        return sum(s.alloc.used for s in self.segments.values()) / cap if cap else 0.0

    def evict(self, now: float, need: int = 0) -> int:
        """Approximate-LRU eviction down from the high watermark (or to make room for ``need``).

        Never takes leased, unfinished or hard-pinned objects; soft-pinned ones go last.
        Returns the number of objects evicted.
        """
        cap = sum(s.alloc.capacity for s in self.segments.values())
        if not cap:
            return 0
        used = sum(s.alloc.used for s in self.segments.values())
        # space held for readers of removed objects frees itself when their leases end:
        # it must not push live objects out
        held = self.graveyard.held_bytes()
        over = used - held - self.config.high_watermark * cap
        target = max(need, over + self.config.evict_ratio * cap if over > 0 else 0)
        if target <= 0:
            return 0
        freed, count = 0, 0
        for soft_pass in (False, True):
            if soft_pass and not self.config.allow_evict_soft_pinned:
                break
            for key in list(self.objects):
                if freed >= target:
                    break
                obj = self.objects[key]
                if not obj.complete or obj.hard_pin or obj.lease_until > now:
                    continue
                if (obj.soft_pin_until > now) != soft_pass or not obj.replicas:
                    continue
                verdict = self.tiers.verdict(key, obj, now)
                if verdict == "keep":  # its disk copy is being made: evictable once it is
                    continue
                if verdict == "demote":  # stays readable from disk
                    freed += self.tiers.demote(key, obj, now)
                else:
                    freed += (obj.hdr + obj.size) * len(obj.replicas)
                    self._drop(key, obj, now)
                count += 1
        self.evicted += count
        return count

    def lease_wait(self, now: float, scan: int = 65536) -> float:
        """Seconds until the first read lease on a replica in memory ends (0: none found among
        the ``scan`` most recently used objects, where leased ones sit). A put that found no
        room because eviction skips leased objects waits that long instead of failing."""
        first = 0.0
        for n, obj in enumerate(reversed(self.objects.values())):
            if n >= scan:
                break
            if obj.lease_until > now and obj.replicas and obj.complete and not obj.hard_pin \
                    and (not first or obj.lease_until < first):
                first = obj.lease_until
        return first - now if first else 0.0

    # -- helpers ---------------------------------------------------------------------------------
    def _soft_pin_ttl(self, cfg: ReplicateConfig) -> float:
        """Seconds of soft pin a put asks for (0: none).

        Raises:
            InvalidParams: a TTL without "enable", an unknown action, or a TTL past the maximum.
        """
        action = cfg.pin_action()
        if action not in ("preserve", "enable", "disable"):
            raise InvalidParams(f"unknown soft_pin_action {action!r}")
        if action != "enable":
            if cfg.soft_pin_ttl_ms is not None:
                raise InvalidParams("soft_pin_ttl_ms needs soft_pin_action ENABLE")
            return 0.0
        ttl = (cfg.soft_pin_ttl_ms / 1000.0 if cfg.soft_pin_ttl_ms is not None
               else self.config.soft_pin_ttl)
        if not 0 <= ttl <= self.config.max_soft_pin_ttl:
            raise InvalidParams(f"soft_pin_ttl_ms {cfg.soft_pin_ttl_ms} is out of range")
        return ttl

    @staticmethod
    def _check_key(key: str) -> None:
        if not key or len(key.encode()) > MAX_KEY:
            raise InvalidKey(f"keys must be 1..{MAX_KEY} bytes")

    def drop_replicas(self, obj: Obj, segments: set[str], now: float) -> int:
        """Take the replicas on ``segments`` out of ``obj`` (the object stays, even with none
        left: the caller decides). Space under a live lease waits for it. Returns how many."""
        gone = [r for r in obj.replicas if r[0] in segments]
        obj.replicas = tuple(r for r in obj.replicas if r[0] not in segments)
        for seg, off, gen in gone:
            if seg not in self.segments:
                continue
            self.adoption.forget(self.segments[seg], off, gen)
            if obj.lease_until > now:
                self._hold_for_readers(seg, off, gen, obj)
            else:
                self.segments[seg].alloc.free(off)
        return len(gone)

    def _drop(self, key: str, obj: Obj, now: float) -> None:
        """Forget an object. Space under a live lease is freed only once the lease ends; space of
        an unfinished put only once its write window is over and its segment fenced it."""
        self.objects.pop(key, None)
        if self.open_puts.get(key) is obj:
            del self.open_puts[key]
        self.repairs.forget(key, now)
        self.tiers.dropped(key, obj, now)
        if obj.complete:
            self.changes.append(("removed", key))
        for seg, off, gen in obj.replicas:
            if seg not in self.segments:
                continue
            self.adoption.forget(self.segments[seg], off, gen)
            if not obj.complete:
                self.graveyard.hold(seg, off, obj.hdr + obj.size, max(obj.window_until, now), gen)
            elif obj.lease_until > now:
                self._hold_for_readers(seg, off, gen, obj)
            else:
                self.segments[seg].alloc.free(off)

    def _hold_for_readers(self, seg: str, off: int, gen: int, obj: Obj) -> None:
        """Hold the space of a complete object's replica until its read lease ends. Clients
        holding that lease may read there without asking again (held reads), so its
        generation is also fenced at the segment (the heartbeat path: early reuse waits for
        it) and queued in ``retiring`` for the caller to retire at once."""
        self.graveyard.hold(seg, off, obj.hdr + obj.size, obj.lease_until, gen, readers_only=True)
        self.retiring.append((seg, gen, obj.lease_until))

    def _candidates(self, cfg: ReplicateConfig, local: frozenset[str]) -> list[str]:
        names = [n for n, s in self.segments.items() if s.suspect_since is None and not s.adopting]
        if not names:
            return []
        pref = [p for p in ([cfg.preferred_segment] if cfg.preferred_segment else [])
                + cfg.preferred_segments if p in self.segments
                and self.segments[p].suspect_since is None and not self.segments[p].adopting]
        if cfg.prefer_alloc_in_same_node:
            pref += [n for n in names if n in local]
        start = self.rng.randrange(len(names))
        rest = names[start:] + names[:start]
        if self.config.allocation_strategy == "free_ratio_first":
            rest.sort(key=lambda n: -self.segments[n].alloc.free_bytes / self.segments[n].alloc.capacity)
        seen: set[str] = set()
        return [n for n in pref + rest if not (n in seen or seen.add(n))]  # type: ignore[func-returns-value]

    def _place(self, size: int, cfg: ReplicateConfig, now: float,
               local: frozenset[str], evict: bool = True) -> list[Rep]:
        for attempt in range(3 if evict else 1):
            got: list[Rep] = []
            gen = self._gen()  # one generation per put: replicas sit on distinct segments
            for name in self._candidates(cfg, local):
                off = self.segments[name].alloc.allocate(size)
                if off is not None:
                    got.append((name, off, gen))
                    if len(got) == cfg.replica_num:
                        break
            if got:  # best effort: at least one replica
                return got
            if not evict:
                break
            self.alloc_failures += 1
            leased = self.graveyard.release_leased() if attempt == 0 else []
            if leased:
                # Out of room: first reuse the space of force-removed objects whose read leases
                # have not ended (``force`` accepted that such a reader may see new bytes, and
                # Mooncake frees it at once; the reader's checksum turns them into a failed
                # read), before evicting anything still live. Space waiting for a fence never.
                for seg, off in leased:
                    if seg in self.segments:
                        self.segments[seg].alloc.free(off)
            elif attempt <= 1:
                self.evict(now, need=size * cfg.replica_num)
            else:
                break
        raise NoAvailableHandle(
            f"no segment has {size} free bytes; consider mounting more segments or lowering "
            "the eviction high watermark")
