"""The master's object table: records, the maps that hold them, and the operations every part
of the master shares. Pure: no I/O, no threads, no clock reads (``now`` comes from the caller).

:class:`ObjectTable` holds segments (with their allocators), clients, and objects (with their
replicas, leases, pins and LRU order), issues generations, places, commits, drops and evicts
objects. It is the layer the master's services build on (adoption ``adopt.py``, repair
``repair.py``, the disk tier ``tiers.py``, spares ``spares.py``, copy/move tasks ``tasks.py``,
data-plane grants ``grants.py``); :class:`~kvplane.store.master.state.MasterState` composes
them over it and adds the per-RPC operations.

The table tells three services what happens to objects (a drop, a commit, an eviction) through
the small protocols below (``ReplicaRepairs``, ``HeaderForgets``, ``TierHooks``); the state
plugs the real ones in. Imports only the master's primitives (config, allocator, fences) and
the eviction policy, never a service, the state, an RPC module or the server.
"""

from __future__ import annotations

import enum
import random
from collections.abc import MutableSet, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import msgspec

from kvplane.store.errors import InvalidKey, InvalidParams, NoAvailableHandle, ObjectNotFound
from kvplane.store.master import eviction
from kvplane.store.master.allocator import OffsetAllocator, Usage
from kvplane.store.master.columns import COMPLETE, HARD_PIN, NONE, Columns, OpenPut
from kvplane.store.master.config import MasterConfig
from kvplane.store.master.eviction import Verdict
from kvplane.store.master.fences import Quarantine
from kvplane.store.master.rows import ObjectsView, Rep, Row
from kvplane.store.types import MAX_KEY, Replica, ReplicateConfig, SegmentInfo
from kvplane.transfer.fence import EPOCH_SHIFT


class Change(str, enum.Enum):
    """What happened to a key, for the pool's KV events (``ObjectTable.changes``)."""

    STORED = "stored"
    REMOVED = "removed"


class Retiring(NamedTuple):
    """A leased object's replica dropped: the caller retires its generation at its segment."""

    segment: str
    gen: int
    lease_until: float


STORED, REMOVED = Change.STORED, Change.REMOVED


_PLACEMENT_FIELDS = frozenset({"suspect_since", "adopting"})
_NO_NAMES: list[str] = []  # (never modified)


@dataclass
class Segment:
    """One mounted segment: its registration, its allocator, and its health."""

    info: SegmentInfo
    alloc: OffsetAllocator
    suspect_since: float | None = None  # a client reported a failed transfer to it
    adopting: bool = False  # re-registering what it holds: no new placements yet
    sid: int = -1  # its id in the object table's replica columns

    # bumped whenever any segment's ``suspect_since`` or ``adopting`` is set: the tables'
    # cached lists of the segments open to placement (``ObjectTable.eligible``) are rebuilt
    changes = 0  # (a class attribute: not a field)

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)
        if name in _PLACEMENT_FIELDS:
            Segment.changes += 1

    def replica(self, off: int, size: int, gen: int = 0, hdr: int = 0) -> Replica:
        """The replica whose allocation starts at ``off``: its value follows the header."""
        return Replica(self.info.name, self.info.base + off + hdr, size, self.info.endpoint,
                       self.info.host_id, gen)


class Obj(msgspec.Struct, gc=False):
    """One object's metadata as a detached record: what :meth:`ObjectTable.insert` stores in
    a row (the table keeps no record per object; :class:`~kvplane.store.master.rows.Row`
    reads and writes a stored one in place)."""

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

    def replicas_of(self, segments: dict[str, Segment], reps: Sequence[Rep] | None = None
                    ) -> list[Replica]:
        """The wire form of ``reps`` (default: every replica) of this object."""
        return [segments[s].replica(o, self.size, g, self.hdr) for s, o, g in
                (self.replicas if reps is None else reps)]


@dataclass
class Client:
    """One client that mounted segments or heartbeats: when it was last heard of."""

    last_seen: float
    segments: set[str] = field(default_factory=set)


@dataclass
class EvictPass:
    """An eviction pass in progress (``ObjectTable.evict_step``): how far it got."""

    target: float  # bytes to free
    freed: int = 0
    count: int = 0
    soft: bool = False  # the second walk: soft-pinned objects may go too
    next_row: int = NONE  # where the walk goes on (if that row still holds ``next_key``)
    next_key: bytes | None = None
    done: bool = False


class ReplicaRepairs(Protocol):
    """What the table tells re-replication (``repair.Repairs``)."""

    @property
    def short(self) -> MutableSet[str]:
        """Keys that may hold fewer replicas than asked for."""

    def forget(self, key: str, now: float) -> None:
        """``key`` was dropped: abandon its repair."""


class HeaderForgets(Protocol):
    """What the table tells adoption (``adopt.Adoption``) when space that may hold an inventory
    header is freed."""

    def forget(self, seg: Segment, off: int, gen: int) -> None:
        """The allocation at ``off`` of ``seg`` (generation ``gen``) was freed."""


class TierHooks(Protocol):
    """What the table asks and tells the disk tier (``tiers.DiskTier``)."""

    def stored(self, key: str, obj: Row) -> None:
        """``key`` was committed."""

    def dropped(self, key: str, obj: Row, now: float) -> None:
        """``obj`` leaves the store (its row is dropped right after)."""

    def verdict(self, key: str, obj: Row, now: float) -> Verdict:
        """How eviction treats ``obj``."""

    def demote(self, key: str, obj: Row, now: float) -> int:
        """Drop ``obj``'s memory replicas (it has a disk copy); bytes freed."""


class ObjectTable:
    """Segments, clients and objects, and the operations the master's services share.

    The caller serialises access (the server's lock). ``repairs``, ``adoption`` and ``tiers``
    are the services the table notifies; :class:`~kvplane.store.master.state.MasterState`
    sets them right after construction.

    Args:
        config: master semantics (leases, watermarks, placement).
        seed: seeds placement's random start.
        epoch: this master's epoch: every generation it issues carries it.
    """

    repairs: ReplicaRepairs
    adoption: HeaderForgets
    tiers: TierHooks

    def __init__(self, config: MasterConfig | None = None, seed: int = 0, epoch: int = 1) -> None:
        self.config = config or MasterConfig()
        self.rng = random.Random(seed)
        self.epoch = epoch
        self.secret = b""  # keys the inventory headers' tags (``inventory.secret_of``)
        self._next_gen = epoch << EPOCH_SHIFT
        # every object, one row each (``columns.py``); ``objects`` views them as a mapping
        # (least recently used first), ``cols.puts`` holds the unfinished puts by row
        self.cols = Columns()
        self.objects = ObjectsView(self.cols)
        self.segments: dict[str, Segment] = {}  # (mount and unmount through add/remove_segment)
        self.seg_by_sid: list[Segment | None] = []  # mounted segments by ``Segment.sid``
        self.usage = Usage()  # bytes mounted and allocated over every segment, kept as they change
        self._mounts = 0  # bumped by each mount and unmount (``eligible``)
        self._eligible: list[str] = []
        self._eligible_key = (-1, -1)
        self.clients: dict[str, Client] = {}
        self.graveyard = Quarantine()  # freed space not yet reusable
        self.gate_until = 0.0  # recovering until then ...
        self.awaiting: set[str] | None = None  # ... or until these segments re-registered
        self.evicted = 0
        self.alloc_failures = 0
        self.largest = 0  # bytes of the largest segment mounted (0: none)
        self.puts = 0  # objects committed (PutEnd or a spare's commit; once each)
        self.changes: list[tuple[Change, str]] = []  # drained by the server (KV events)
        # replicas of leased objects dropped since the server last took them: the caller
        # retires them at their segments (held reads, ``drop_object``)
        self.retiring: list[Retiring] = []

    # -- generations and the recovery gate ---------------------------------------------------
    def new_generation(self) -> int:
        """A generation for a new allocation: this master's epoch and the next counter. Data
        frames carry it; segments refuse fenced or older ones (``kvplane.transfer.fence``)."""
        self._next_gen += 1
        return self._next_gen

    def floor(self) -> int:
        """The lowest generation this master can issue from now on."""
        return self._next_gen + 1

    def recover(self, now: float, grace: float, awaiting: set[str] | None) -> None:
        """Answer misses with ``Recovering`` for up to ``grace`` seconds, or until every segment
        in ``awaiting`` (None: unknown) has re-registered."""
        self.gate_until = now + grace
        self.awaiting = None if awaiting is None else set(awaiting)

    def recovering(self, now: float) -> bool:
        """True while misses may still be objects that segments have not re-registered."""
        return now < self.gate_until and (self.awaiting is None or bool(self.awaiting))

    # -- lookups -------------------------------------------------------------------------------
    @staticmethod
    def check_key(key: str) -> None:
        """Refuse a key the master does not store.

        Raises:
            InvalidKey: empty, or longer than ``MAX_KEY`` bytes.
        """
        if not key or len(key.encode()) > MAX_KEY:
            raise InvalidKey(f"keys must be 1..{MAX_KEY} bytes")

    def segments_of(self, client_id: str) -> set[str]:
        """Names of the segments ``client_id`` mounted (a copy; empty for an unknown client)."""
        client = self.clients.get(client_id)
        return set(client.segments) if client is not None else set()

    def used_ratio(self) -> float:
        """Bytes allocated over bytes mounted, every segment together (0: none mounted); O(1)."""
        return self.usage.ratio()

    def eligible(self) -> list[str]:
        """Names of the segments new objects may be placed on (neither suspect nor adopting),
        in mount order. Cached until a segment mounts, unmounts or changes either: the caller
        must not modify the list."""
        key = (self._mounts, Segment.changes)
        if key != self._eligible_key:
            self._eligible = [n for n, s in self.segments.items()
                              if s.suspect_since is None and not s.adopting]
            self._eligible_key = key
        return self._eligible

    # -- rows ------------------------------------------------------------------------------------
    def add_segment(self, seg: Segment) -> None:
        """Mount ``seg`` (its name is free): it gets its id in the replica columns."""
        seg.sid = self.cols.new_sid(seg.info.name)
        while len(self.seg_by_sid) <= seg.sid:
            self.seg_by_sid.append(None)
        self.seg_by_sid[seg.sid] = seg
        self.segments[seg.info.name] = seg
        self.usage.attach(seg.alloc)
        self._mounts += 1

    def remove_segment(self, name: str) -> Segment | None:
        """Take segment ``name`` out of the pool's segments and totals (its replicas stay in
        the columns for the caller's sweep); None when it is not mounted."""
        seg = self.segments.pop(name, None)
        if seg is not None:
            self.usage.detach(seg.alloc)
            self._mounts += 1
        return seg

    def resize_segment(self, seg: Segment, capacity: int) -> None:
        """Re-cut mounted ``seg`` to ``capacity`` bytes in place (``OffsetAllocator.resized``:
        every allocation stays).

        Raises:
            InvalidArgument: an allocation would end past ``capacity``.
        """
        alloc = seg.alloc.resized(capacity)
        self.usage.detach(seg.alloc)
        seg.alloc = alloc
        self.usage.attach(alloc)
        seg.info.size = capacity
        self.largest = max(s.alloc.capacity for s in self.segments.values())

    @property
    def open_puts(self) -> dict[str, Row]:
        """Unfinished puts: key -> row (the timer looks at these, never at every object)."""
        cols = self.cols
        return {cols.key(r): Row(cols, r) for r in cols.puts}

    def insert(self, key: str, obj: Obj) -> Row:
        """Store ``obj`` as ``key`` (not present) in a new row, the most recently used."""
        c = self.cols
        row = c.add(key)
        c.size[row], c.version[row], c.checksum[row] = obj.size, obj.version, obj.checksum
        c.lease[row], c.hdr[row], c.want[row] = obj.lease_until, obj.hdr, obj.want
        c.iflags[row] = obj.flags
        c.flags[row] = (COMPLETE if obj.complete else 0) | (HARD_PIN if obj.hard_pin else 0)
        c.owner[row] = c.owner_id(obj.owner) if obj.owner else 0
        reps = obj.replicas
        if len(reps) == 1:  # the common case, without a list
            name, c.off[row], c.gen[row] = reps[0]
            c.seg[row] = c.sid_of[name]
        elif reps:
            sid_of = c.sid_of
            c.set_replicas(row, [(sid_of[s], o, g) for s, o, g in reps])
        if obj.soft_pin_until:
            c.pins[row] = obj.soft_pin_until
        if obj.disk:
            c.disk[row] = dict(obj.disk)
        if not obj.complete:
            c.puts[row] = OpenPut(obj.started, obj.writer, obj.window_until, obj.header,
                                  obj.nonce, obj.soft_pin_ttl)
        return Row(c, row)

    def row_of(self, key: str) -> Row | None:
        """The stored object ``key``, or None."""
        row = self.cols.index.find(key)
        return Row(self.cols, row) if row >= 0 else None

    # -- commits and drops ---------------------------------------------------------------------
    def insert_complete(self, key: str, obj: Obj) -> None:
        """Add ``obj`` as the committed object ``key`` (re-registered by a segment or a disk
        node): announced like a put, marked for repair when short of replicas."""
        self.insert(key, obj)
        self.changes.append((STORED, key))
        if 0 < len(obj.replicas) < obj.want:
            self.repairs.short.add(key)

    def write_window(self, asked: float) -> float:
        """The write window granted for a client's ``asked`` seconds (0: the default)."""
        return min(asked or self.config.write_window, self.config.put_discard_timeout)

    def put_end(self, key: str, now: float, version: int = 0, checksum: int = 0) -> int:
        """Make a written object visible (0, or an error code).

        ``version``: the one PutStart gave (0: not checked). A put that was pre-empted, revoked
        or lost with its segments gets ObjectNotFound: it was not committed.
        """
        c = self.cols
        row = c.index.find(key)
        if row < 0 or (version and c.version[row] != version):
            return ObjectNotFound.code
        self.complete_row(row, key, now, checksum)
        return 0

    def complete_row(self, row: int, key: str, now: float, checksum: int = 0) -> None:
        """``put_end`` of ``key``'s ``row``, found and its version checked by the caller."""
        c = self.cols
        if not c.flags[row] & COMPLETE:
            c.flags[row] |= COMPLETE
            self.puts += 1
            put = c.puts.pop(row, None)
            if not c.checksum[row]:
                c.checksum[row] = checksum
            self.changes.append((STORED, key))
            if put is not None and put.soft_pin_ttl:
                c.pins[row] = now + put.soft_pin_ttl
            c.touch(row)
            obj = Row(c, row)
            if c.want[row] > 1 and obj.replica_count() < c.want[row]:
                self.repairs.short.add(key)
            self.tiers.stored(key, obj)

    def put_revoke(self, key: str, now: float, version: int = 0) -> int:
        """Abandon an unfinished put. Its space is fenced on its segments before reuse."""
        obj = self.row_of(key)
        if obj is None or obj.complete or (version and obj.version != version):
            return ObjectNotFound.code
        obj.window_until = now  # the writer's own copies are over; only frames may be in flight
        self.drop_object(key, obj, now)
        return 0

    def drop_replicas(self, obj: Row, segments: set[str], now: float) -> int:
        """Take the replicas on ``segments`` out of ``obj`` (the object stays, even with none
        left: the caller decides). Space under a live lease waits for it. Returns how many."""
        reps = obj.replicas
        gone = [r for r in reps if r[0] in segments]  # r: (segment, offset, gen)
        obj.replicas = tuple(r for r in reps if r[0] not in segments)
        lease = obj.lease_until
        for seg, off, gen in gone:  # (replicas are on mounted segments only)
            self.adoption.forget(self.segments[seg], off, gen)
            if lease > now:
                self._hold_for_readers(seg, off, gen, obj)
            else:
                self.segments[seg].alloc.free(off, obj.hdr + obj.size)
        return len(gone)

    def drop_object(self, key: str, obj: Row, now: float) -> None:
        """Forget an object. Space under a live lease is freed only once the lease ends; space of
        an unfinished put only once its write window is over and its segment fenced it."""
        self.repairs.forget(key, now)
        self.tiers.dropped(key, obj, now)
        complete, lease = obj.complete, obj.lease_until
        if complete:
            self.changes.append((REMOVED, key))
        window = obj.window_until
        for seg, off, gen in obj.replicas:  # (replicas are on mounted segments only)
            self.adoption.forget(self.segments[seg], off, gen)
            if not complete:
                self.graveyard.hold(seg, off, obj.hdr + obj.size, max(window, now), gen)
            elif lease > now:
                self._hold_for_readers(seg, off, gen, obj)
            else:
                self.segments[seg].alloc.free(off, obj.hdr + obj.size)
        self.cols.drop(obj.row)

    def _hold_for_readers(self, seg: str, off: int, gen: int, obj: Row) -> None:
        """Hold the space of a complete object's replica until its read lease ends. Clients
        holding that lease may read there without asking again (held reads), so its
        generation is also fenced at the segment (the heartbeat path: early reuse waits for
        it) and queued in ``retiring`` for the caller to retire at once."""
        self.graveyard.hold(seg, off, obj.hdr + obj.size, obj.lease_until, gen, readers_only=True)
        self.retiring.append(Retiring(seg, gen, obj.lease_until))

    # -- eviction ------------------------------------------------------------------------------
    def evict(self, now: float, need: int = 0) -> int:
        """Approximate-LRU eviction down from the high watermark (or to make room for ``need``),
        by the rules of ``eviction.py``; an object with a disk copy is demoted, not dropped.
        The whole pass at once (the server runs it in steps: ``evict_start``/``evict_step``).

        Returns:
            The number of objects evicted.
        """
        job = self.evict_start(need)
        while job is not None and not self.evict_step(job, now, 1 << 62):
            pass
        return job.count if job is not None else 0

    def evict_start(self, need: int = 0) -> EvictPass | None:
        """A pass that frees what :meth:`evict` would (None: nothing must go)."""
        cap, used = self.usage.capacity, self.usage.used
        if not cap:
            return None
        target = eviction.target_bytes(self.config, used, self.graveyard.held_bytes(), cap, need)
        return EvictPass(target) if target > 0 else None

    def evict_step(self, job: EvictPass, now: float, budget: int) -> bool:
        """Walk up to ``budget`` objects of ``job``'s pass, oldest first, evicting candidates;
        True when the pass is over. Between steps the caller may serve others: the walk goes
        on after the last object it looked at (from the oldest again if that one went)."""
        c = self.cols
        row = job.next_row
        if row < 0 or c.keys[row] is not job.next_key:
            row = c.head
        nxt = c.nxt
        while not job.done and budget > 0:
            if row < 0 or job.freed >= job.target:
                if job.soft or job.freed >= job.target or not self.config.allow_evict_soft_pinned:
                    job.done = True
                    break
                job.soft, row = True, c.head
                continue
            budget -= 1
            following = nxt[row]
            self._evict_one(job, Row(c, row), now)
            row = following
        job.next_row, job.next_key = row, c.keys[row] if row >= 0 else None
        return job.done

    def _evict_one(self, job: EvictPass, obj: Row, now: float) -> None:
        if not eviction.evictable(obj, now, job.soft):
            return
        key = obj.key
        verdict = self.tiers.verdict(key, obj, now)
        if verdict is Verdict.KEEP:
            return
        if verdict is Verdict.DEMOTE:
            job.freed += self.tiers.demote(key, obj, now)
        else:
            job.freed += (obj.hdr + obj.size) * obj.replica_count()
            self.drop_object(key, obj, now)
        job.count += 1
        self.evicted += 1

    # -- placement -----------------------------------------------------------------------------
    def soft_pin_ttl(self, cfg: ReplicateConfig) -> float:
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

    def _candidates(self, cfg: ReplicateConfig, local: frozenset[str]
                    ) -> tuple[list[str], list[str], int]:
        """The segments to try, in order, as ``(first, names, start)``: each of ``first``,
        then ``names[start:]`` and ``names[:start]`` less those in ``first``. ``names`` is the
        cached ``eligible`` list, rotated at a random start; ``first`` the preferred segments
        that are open to placement (a few names). A put that lands on a preferred segment, or
        has none, does no work that grows with the pool's segments (``free_ratio_first``, which
        sorts them all, and ``prefer_alloc_in_same_node`` still walk them)."""
        names = self.eligible()
        if len(names) < 2 and not cfg.preferred_segment and not cfg.preferred_segments:
            return _NO_NAMES, names, 0  # (one segment or none: the common case on small pools)
        if not names:
            return _NO_NAMES, _NO_NAMES, 0
        segs = self.segments
        pref = [p for p in ([cfg.preferred_segment] if cfg.preferred_segment else [])
                + cfg.preferred_segments if p in segs
                and segs[p].suspect_since is None and not segs[p].adopting]
        if cfg.prefer_alloc_in_same_node:
            pref += [n for n in names if n in local]
        start = int(self.rng.random() * len(names))  # (randrange's cost, per put, was visible)
        if self.config.allocation_strategy == "free_ratio_first":
            rest = names[start:] + names[:start]
            rest.sort(key=lambda n: -segs[n].alloc.free_bytes / segs[n].alloc.capacity)
            return _NO_NAMES, list(dict.fromkeys(pref + rest)), 0  # first occurrence of each
        return (list(dict.fromkeys(pref)) if pref else _NO_NAMES), names, start

    def place(self, size: int, cfg: ReplicateConfig, now: float,
              local: frozenset[str], evict: bool = True) -> list[Rep]:
        """Allocate ``size`` bytes on up to ``cfg.replica_num`` distinct segments, all under
        one new generation (best effort: at least one).

        Args:
            size: bytes of each allocation (header and value).
            cfg: replica count and segment preferences.
            now: the caller's clock (eviction's leases).
            local: the segments on the caller's hosts (``prefer_alloc_in_same_node``).
            evict: out of room, reuse force-removed space and evict (else fail at once).

        Raises:
            NoAvailableHandle: no segment has room.
        """
        for attempt in range(3 if evict else 1):
            got: list[Rep] = []
            gen = self.new_generation()  # one generation per put: replicas sit on distinct segments
            first, names, start = self._candidates(cfg, local)
            want, segs = cfg.replica_num, self.segments
            for name in first:
                off = segs[name].alloc.allocate(size)
                if off is not None:
                    got.append((name, off, gen))
                    if len(got) == want:
                        break
            n = len(names) if len(got) < want else 0
            for k in range(start, start + n):
                name = names[k - n if k >= n else k]
                if first and name in first:
                    continue  # (tried first)
                off = segs[name].alloc.allocate(size)
                if off is not None:
                    got.append((name, off, gen))
                    if len(got) == want:
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
                for seg, off, held in leased:
                    if seg in self.segments:
                        self.segments[seg].alloc.free(off, held)
            elif attempt <= 1:
                self.evict(now, need=size * cfg.replica_num)
            else:
                break
        raise NoAvailableHandle(
            f"no segment has {size} free bytes; consider mounting more segments or lowering "
            "the eviction high watermark")
