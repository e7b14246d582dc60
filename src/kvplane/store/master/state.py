"""MasterState: the store's metadata state machine. Pure: no I/O, no threads, no clock reads.

Every method takes ``now`` (seconds, monotonic) from the caller, so tests replay any timeline.
Holds segments (with their allocators), clients (with heartbeats), and objects (with replicas,
leases, pins and LRU order). Replicas of one object sit on distinct segments. The caller
serialises access (one lock in the server).

Layers: the records and the operations the services share are the object table
(``table.py``, a base class); the services over it (``adopt.py``, ``repair.py``, ``tiers.py``,
``tasks.py``) take the table, never this class; this module composes them and adds what the
RPCs call (mount, heartbeat, put, lookups, removal, the timer's passes). It must not import
an RPC module or the server.

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

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvplane.common.errors import InvalidArgument, KVPlaneError
from kvplane.store import inventory
from kvplane.store.errors import (
    InvalidParams,
    NoAvailableHandle,
    ObjectExists,
    ObjectHasLease,
    ObjectNotFound,
    ReplicaNotReady,
    SegmentExists,
    SegmentNotFound,
    ValueTooLarge,
)
from kvplane.store.master.adopt import Adoption
from kvplane.store.master.allocator import OffsetAllocator
from kvplane.store.master.columns import COMPLETE, HARD_PIN, NONE, OpenPut
from kvplane.store.master.config import MasterConfig
from kvplane.store.master.repair import Repairs
from kvplane.store.master.rows import Row
from kvplane.store.master.table import REMOVED, Client, Obj, ObjectTable, Segment
from kvplane.store.master.tasks import Tasks
from kvplane.store.master.tiers import DiskTier
from kvplane.store.types import (
    MAX_KEY,
    MAX_VALUE,
    Columns,
    KeyResult,
    Location,
    Replica,
    ReplicateConfig,
    SegmentInfo,
)

__all__ = ["Client", "MasterState", "Obj", "Row", "Segment"]  # the records live in ``table``

SWEEP_SCAN = 1 << 15  # rows an unmount's sweep scans at a time (a vectorised scan) ...
SCAN_COST = 32  # ... which counts as this many objects of a step's budget


@dataclass
class Sweep:
    """An unmounted segment's replicas being taken out of their objects, in steps
    (``MasterState.sweep_step``). Until the sweep reaches a row, readers already skip the
    replica (its segment id is not live)."""

    sid: int
    pos: int = 0  # rows below were scanned
    found: list[int] = field(default_factory=list)  # rows scanned, not processed yet
    lost: int = 0  # objects that went with it


class MasterState(ObjectTable):
    """All store metadata: the object table (``table.py``), the services over it (adoption,
    repair, the disk tier, copy/move tasks), and the operations the RPCs call. See the module
    docstring for the threading and clock contract.

    Args:
        config: master semantics (leases, watermarks, placement).
        seed: seeds placement's random start.
        epoch: this master's epoch (a leader's term, or random for a lone master).
    """

    repairs: Repairs
    adoption: Adoption
    tiers: DiskTier

    def __init__(self, config: MasterConfig | None = None, seed: int = 0, epoch: int = 1) -> None:
        super().__init__(config, seed, epoch)
        self.repairs = Repairs(self)
        self.adoption = Adoption(self)
        self.tiers = DiskTier(self, self.adoption.order)
        # copy/move tasks: a new leader term starts a new table (their runners see
        # TASK_NOT_FOUND, and the targets were never joined)
        self.tasks = Tasks(self)
        self.view_version = 1
        self.sweeps: list[Sweep] = []  # unmounts whose rows are still being swept

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
            self.add_segment(Segment(info, OffsetAllocator(info.size), adopting=adopt))
            client.segments.add(info.name)
            self.largest = max(self.largest, info.size)
        return self.floor()

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

    def unmount(self, name: str) -> int:
        """Drop a segment and every replica on it; returns objects lost entirely (the whole
        sweep at once: the server runs it in steps, ``unmount_start``/``sweep_step``)."""
        sweep = self.unmount_start(name)
        if sweep is None:
            return 0
        while not self.sweep_step(sweep, 1 << 62):
            pass
        return sweep.lost

    def unmount_start(self, name: str) -> Sweep | None:
        """Unmount segment ``name``: from now on no reader sees a replica there (its id is not
        live); the returned sweep (also in ``sweeps``) takes them out of their objects and
        drops the objects left with none. None: not mounted."""
        seg = self.remove_segment(name)
        if seg is None:
            return None
        client = self.clients.get(seg.info.client_id)
        if client:
            client.segments.discard(name)
        self.largest = max((s.alloc.capacity for s in self.segments.values()), default=0)
        self.graveyard.drop_segment(name)
        self.repairs.drop_segment(name)
        self.adoption.drop_segment(name)
        self.tasks.drop_segment(name)
        if self.awaiting is not None:
            self.awaiting.discard(name)
        sweep = Sweep(self.cols.retire_sid(name))
        self.seg_by_sid[sweep.sid] = None
        for key in self.tiers.drop_segment(name):  # objects it held on disk only
            row = self.cols.index.find(key)
            self.repairs.forget(key, 0.0)
            self.changes.append((REMOVED, key))
            self.cols.drop(row)
            sweep.lost += 1
        self.sweeps.append(sweep)
        return sweep

    def sweep_step(self, sweep: Sweep, budget: int) -> bool:
        """Take the swept segment's replicas out of up to ``budget`` objects (scanning at most
        ``SWEEP_SCAN`` rows); True when the sweep is over (its segment id is free again)."""
        c = self.cols
        while budget > 0:
            if not sweep.found:
                if sweep.pos >= c.scan_end():
                    c.release_sid(sweep.sid)
                    self.sweeps.remove(sweep)
                    return True
                sweep.found, sweep.pos = c.rows_on(sweep.sid, sweep.pos, sweep.pos + SWEEP_SCAN)
                budget -= SCAN_COST
                continue
            row = sweep.found.pop()
            budget -= 1
            if c.keys[row] is not None and self._holds(row, sweep.sid):
                sweep.lost += self._lose_replica(row)
        return False

    def _holds(self, row: int, sid: int) -> bool:
        c = self.cols
        if c.seg[row] == sid:
            return True
        r = c.more[row]
        while r >= 0:
            if c.rseg[r] == sid:
                return True
            r = c.rnext[r]
        return False

    def _lose_replica(self, row: int) -> int:
        """``row`` had a replica on an unmounted segment: keep the others (then it is short of
        one), or drop it when none is left (1: an object lost)."""
        c = self.cols
        keep = c.replicas(row)  # the live ones
        c.set_replicas(row, keep)
        complete = bool(c.flags[row] & COMPLETE)
        if not keep and row not in c.disk:
            if complete:
                self.changes.append((REMOVED, c.key(row)))
            c.drop(row)
            return 1
        if complete and keep:
            c.mark_short(row)  # (``repairs.short``: the bit, no key object per row)
        return 0

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

    def expire_clients(self, now: float, sweep: bool = True) -> list[str]:
        """Unmount the segments of clients silent for longer than the TTL (``sweep``: their
        sweeps to the end at once, else left in ``sweeps`` for the caller's steps)."""
        dead = [cid for cid, c in self.clients.items()
                if now - c.last_seen > self.config.client_ttl]
        for cid in dead:
            for name in list(self.clients[cid].segments):
                if sweep:
                    self.unmount(name)
                else:
                    self.unmount_start(name)
            del self.clients[cid]
        if dead:  # their unfinished puts will never end: fence and free them
            gone = set(dead)
            for obj in [o for o in self.open_puts.values() if o.writer in gone]:
                self.drop_object(obj.key, obj, now)
        return dead

    # -- writes ----------------------------------------------------------------------------------
    def put_start(self, key: str, size: int, cfg: ReplicateConfig, now: float,
                  upsert: bool = False, local_segments: frozenset[str] = frozenset(),
                  client_id: str = "", window: float = 0.0, checksum: int = 0,
                  nonce: int = 0, owner: str = "") -> KeyResult:
        """Allocate replicas for a new object; it stays invisible until put_end.

        ``window``: seconds the writer may copy (its deadline); its space is not reused before
        the window is over, even if the put is pre-empted. 0 means ``config.write_window``.
        ``checksum``: of the value (the inventory header carries it). The result carries the
        header the writer copies in front of the value of every replica. ``nonce``: the call's
        own id; the same writer asking again with the same nonce (its first answer was lost)
        gets the same allocations back. ``owner``: the client id the object records as its
        maker (Mooncake's ``metadata.client_id``; a slot move's import leaves it empty).

        Returns a KeyResult with code 0, the replicas and the object's version, or a negative
        error code.
        """
        try:
            self.check_key(key)
            if not 0 < size <= MAX_VALUE:
                raise InvalidParams(f"object size {size} out of range")
            if cfg.replica_num < 1:
                raise InvalidParams("replica_num must be >= 1")
            pin = self.soft_pin_ttl(cfg)
            hdr = inventory.header_len(key)
            if self.largest and hdr + size > self.largest:  # no eviction can ever make room
                return KeyResult(ValueTooLarge.code, size=self.largest)
            old = self.objects.get(key)
            if old is not None and old.complete and self._swept_away(old.row):
                # lost with its segment, not yet swept: a put makes it anew (a put that said
                # "exists" here was acknowledged and then never found)
                self.drop_object(key, old, now)
                old = None
            kept_pin = old.soft_pin_until if old is not None and old.complete else 0.0
            if old is not None:
                if old.complete and not upsert:
                    raise ObjectExists(f"{key!r} exists")
                if not old.complete and nonce and old.nonce == nonce and old.writer == client_id:
                    return self._resume(key, old, now, window, owner)  # a retried PutStart
                if not old.complete and now - old.started < self.config.put_discard_timeout:
                    raise ObjectExists(f"{key!r} is being written")
                self.drop_object(key, old, now)
            elif len(self.objects) >= self.config.max_keys:
                raise NoAvailableHandle("the master holds its maximum number of keys")
            replicas = self.place(hdr + size, cfg, now, local_segments)
        except KVPlaneError as exc:
            return KeyResult(exc.code)
        flags = inventory.FLAG_HARD_PIN if cfg.with_hard_pin else 0
        version = replicas[0][2]  # the put's generation
        header = inventory.pack(self.secret, key, version, version, size, checksum,
                                cfg.replica_num, flags, hdr)
        obj = Obj(size, tuple(replicas), False, now, hard_pin=cfg.with_hard_pin, version=version,
                  want=cfg.replica_num, writer=client_id, checksum=checksum, nonce=nonce,
                  window_until=now + self.write_window(window), hdr=hdr, flags=flags,
                  soft_pin_ttl=pin,
                  soft_pin_until=kept_pin if cfg.pin_action() == "preserve" else 0.0,
                  header=header, owner=owner)
        self.insert(key, obj)
        return KeyResult(0, obj.replicas_of(self.segments), size, version, checksum, header)

    def put_start_many(self, keys: Sequence[str], sizes: Sequence[int], sums: Sequence[int],
                       cfg: ReplicateConfig, now: float, client_id: str, window: float,
                       nonce: int, general: Callable[[int], KeyResult]) -> list[KeyResult]:
        """``put_start`` of each key of one PutStart call (no upsert, no local segments),
        the same answers, in the same order: the per-call checks are made once, and a new key
        on a pool where placement has one candidate is written straight into the table (the
        common batch of fresh keys: no record object per key). Any other key goes through
        ``general(i)`` (``put_start`` of key ``i``), in its turn.

        ``window``: the write window granted (``write_window``), as ``put_start`` computes it.
        The client id is each object's writer and its owner.
        """
        try:
            pin = self.soft_pin_ttl(cfg)
        except KVPlaneError:
            return [general(i) for i in range(len(keys))]  # (each key answered the error)
        names = self.eligible()  # (as ``_candidates``: no rng draw)
        if len(names) != 1 or cfg.replica_num != 1 or cfg.preferred_segment \
                or cfg.preferred_segments:
            return [general(i) for i in range(len(keys))]
        seg = self.segments[names[0]]
        alloc, info = seg.alloc, seg.info
        name, base, endpoint, host = info.name, info.base, info.endpoint, info.host_id
        flags = inventory.FLAG_HARD_PIN if cfg.with_hard_pin else 0
        cflags = HARD_PIN if cfg.with_hard_pin else 0
        c = self.cols
        find, sid, owner = c.index.find, c.sid_of[name], c.owner_id(client_id) if client_id else 0
        secret, largest, max_keys = self.secret, self.largest, self.config.max_keys
        until = now + self.write_window(window)
        out: list[KeyResult] = []
        for i, key in enumerate(keys):
            size = sizes[i]
            kb = key.encode()
            hdr = inventory.header_len(kb)
            if not kb or len(kb) > MAX_KEY or not 0 < size <= MAX_VALUE or find(key) >= 0 \
                    or (largest and hdr + size > largest) or c.count >= max_keys:
                out.append(general(i))  # (an error or a present key: the full path)
                continue
            off = alloc.allocate(hdr + size)
            if off is None:
                out.append(general(i))  # out of room: place() evicts or fails
                continue
            version = self.new_generation()
            checksum = sums[i]
            header = inventory.pack(secret, key, version, version, size, checksum,
                                    1, flags, hdr)
            row = c.add(key)
            c.size[row], c.version[row], c.checksum[row] = size, version, checksum
            c.lease[row], c.hdr[row], c.want[row] = 0.0, hdr, 1
            c.iflags[row], c.flags[row], c.owner[row] = flags, cflags, owner
            c.off[row], c.gen[row], c.seg[row] = off, version, sid
            c.puts[row] = OpenPut(now, client_id, until, header, nonce, pin)
            out.append(KeyResult(0, [Replica(name, base + off + hdr, size, endpoint, host,
                                             version)], size, version, checksum, header))
        return out

    def _resume(self, key: str, obj: Row, now: float, window: float, owner: str) -> KeyResult:
        """The same writer asks again for its unfinished put (its first answer was lost):
        the same allocations, with a fresh write window."""
        obj.window_until = max(obj.window_until, now + self.write_window(window))
        if owner:
            obj.owner = owner
        return KeyResult(0, obj.replicas_of(self.segments), obj.size, obj.version, obj.checksum,
                         obj.header)

    def _plain(self, row: int) -> Segment | None:
        """The segment of ``row``'s only replica when it is a complete object with exactly one
        replica and no SSD copy (the common case the lookups inline), else None."""
        c = self.cols
        sid = c.seg[row]
        if sid < 0 or not c.flags[row] & COMPLETE or c.more[row] != NONE or row in c.disk:
            return None
        return self.seg_by_sid[sid]

    def get_replicas(self, key: str, now: float) -> KeyResult:
        """Replicas of a complete object; grants a read lease and refreshes its LRU position."""
        c = self.cols
        row = c.index.find(key)
        if row < 0:
            return KeyResult(ObjectNotFound.code)
        seg = self._plain(row)
        if seg is not None:
            return self._plain_result(row, seg, now + self.config.lease_ttl)
        obj = Row(c, row)
        if not obj.complete:
            return KeyResult(ReplicaNotReady.code)
        reps = list(obj.replicas)
        disk = obj.disk
        if not reps and not disk:  # its last replica's segment went (being swept)
            return KeyResult(ObjectNotFound.code)
        obj.lease_until = max(obj.lease_until, now + self.config.lease_ttl)
        self.cols.touch(obj.row)
        if len(reps) > 1 and any(self.segments[s].suspect_since is not None for s, _, _ in reps):
            reps.sort(key=lambda r: self.segments[r[0]].suspect_since is not None)
        return KeyResult(0, obj.replicas_of(self.segments, reps), obj.size, obj.version,
                         obj.checksum, disk=self.tiers.disk_replicas(key, obj) if disk else [])

    def _plain_result(self, row: int, seg: Segment, until: float) -> KeyResult:
        """The lookup of a plain object (``_plain``): its lease to ``until``, LRU move, answer."""
        c = self.cols
        if c.lease[row] < until:
            c.lease[row] = until
        c.touch(row)
        n = c.size[row]
        return KeyResult(0, [seg.replica(c.off[row], n, c.gen[row], c.hdr[row])], n,
                         c.version[row], c.checksum[row])

    def get_replicas_many(self, keys: list[str], now: float) -> list[KeyResult]:
        """:meth:`get_replicas` of each key (the same leases and LRU moves)."""
        c = self.cols
        find, touch, by_sid = c.index.find, c.touch, self.seg_by_sid
        flags, more, sids, disk, lease = c.flags, c.more, c.seg, c.disk, c.lease
        until = now + self.config.lease_ttl
        out: list[KeyResult] = []
        for key in keys:  # ``_plain`` and ``_plain_result`` inlined (the hot loop)
            row = find(key)
            sid = sids[row] if row >= 0 else NONE
            s = by_sid[sid] if sid >= 0 and flags[row] & COMPLETE and more[row] == NONE \
                and row not in disk else None
            if s is None:
                out.append(self.get_replicas(key, now))
                continue
            if lease[row] < until:
                lease[row] = until
            touch(row)
            n = c.size[row]
            out.append(KeyResult(0, [s.replica(c.off[row], n, c.gen[row], c.hdr[row])], n,
                                 c.version[row], c.checksum[row]))
        return out

    def columns_many(self, keys: list[str], now: float) -> Columns | None:
        """:meth:`get_replicas_many` as :class:`Columns`, with the same leases and LRU moves,
        when every key is a complete object with one replica and no copy on disk; else None
        (the leases and moves already given are those :meth:`get_replicas_many` gives
        again)."""
        c = self.cols
        find, touch, by_sid = c.index.find, c.touch, self.seg_by_sid
        flags, more, sids, disk, lease = c.flags, c.more, c.seg, c.disk, c.lease
        until = now + self.config.lease_ttl
        names: dict[str, int] = {}
        seg: list[int] = []
        addr: list[int] = []
        size: list[int] = []
        gen: list[int] = []
        for key in keys:  # ``_plain`` inlined: this is the pool's hottest loop
            row = find(key)
            if row < 0:
                return None
            sid = sids[row]
            if sid < 0 or not flags[row] & COMPLETE or more[row] != NONE or row in disk:
                return None
            s = by_sid[sid]
            if s is None:
                return None
            if lease[row] < until:
                lease[row] = until
            touch(row)
            name = s.info.name
            j = names.get(name)
            if j is None:
                j = names[name] = len(names)
            seg.append(j)
            addr.append(s.info.base + c.off[row] + c.hdr[row])
            size.append(c.size[row])
            gen.append(c.gen[row])
        return Columns(list(names), seg, addr, size, gen)

    def confirm_many(self, keys: list[str], expect: list[Location | None], now: float
                     ) -> tuple[list[int], list[KeyResult]]:
        """:meth:`get_replicas_many` for a client that read each key from ``expect`` meanwhile:
        a key whose complete object still has a replica at that location (segment, value
        address, generation, size) gets its lease and LRU move and no answer; the others are
        returned as (their indexes, their :meth:`get_replicas`)."""
        c, segments = self.cols, self.segments
        until = now + self.config.lease_ttl
        stale: list[int] = []
        out: list[KeyResult] = []
        for i, (key, loc) in enumerate(zip(keys, expect, strict=True)):
            row = c.index.find(key) if loc is not None else NONE
            if loc is not None and row >= 0 and c.flags[row] & COMPLETE:
                where, addr, gen, size = loc
                hdr = c.hdr[row]
                if c.size[row] == size and any(
                        g == gen and name == where and segments[name].info.base + off + hdr == addr
                        for name, off, g in Row(c, row).replicas):
                    if c.lease[row] < until:
                        c.lease[row] = until
                    c.touch(row)
                    continue
            stale.append(i)
            out.append(self.get_replicas(key, now))
        return stale, out

    def exist(self, key: str, now: float) -> int:
        """1 if a complete object exists (and lease it, as Mooncake's ExistKey does), else 0."""
        c = self.cols
        row = c.index.find(key)
        if row < 0 or not c.flags[row] & COMPLETE:
            return 0
        if self._swept_away(row):
            return 0  # its last replica's segment went (being swept)
        until = now + self.config.lease_ttl
        if c.lease[row] < until:
            c.lease[row] = until
        return 1

    def _swept_away(self, row: int) -> bool:
        """Every copy of the object at ``row`` was on segments that are gone (an unmount's sweep
        has not reached it yet): it is lost, whatever its flags say."""
        c = self.cols
        sid = c.seg[row]
        return (sid < 0 or not c.live[sid]) and not Row(c, row).replica_count() and \
            row not in c.disk

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
        self.drop_object(key, obj, now)
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
        for seg, off, size in due:
            if seg in self.segments:
                self.segments[seg].alloc.free(off, size)
        c = self.cols
        stale = [r for r, p in c.puts.items() if now - p.started > self.config.put_release_timeout]
        for row in stale:  # (``puts`` entries go with their rows: each is live)
            self.drop_object(c.key(row), Row(c, row), now)
        return len(due) + len(stale)

    def lease_wait(self, now: float, scan: int = 65536) -> float:
        """Seconds until the first read lease on a replica in memory ends (0: none found among
        the ``scan`` most recently used objects, where leased ones sit). A put that found no
        room because eviction skips leased objects waits that long instead of failing."""
        first = 0.0
        c = self.cols
        for n, row in enumerate(c.rows_newest()):
            if n >= scan:
                break
            until = c.lease[row]
            if until > now and c.flags[row] & (COMPLETE | HARD_PIN) == COMPLETE \
                    and (not first or until < first) and Row(c, row).replica_count():
                first = until
        return first - now if first else 0.0
