"""MasterState: the store's metadata state machine. Pure: no I/O, no threads, no clock reads.

Every method takes ``now`` (seconds, monotonic) from the caller, so tests replay any timeline.
Holds segments (with their allocators), clients (with heartbeats), and objects (with replicas,
leases, pins and LRU order). Replicas of one object sit on distinct segments. The caller
serialises access (one lock in the server).
"""

from __future__ import annotations

import random
import re
from collections import OrderedDict
from dataclasses import dataclass, field

from kvplane.common.errors import InvalidArgument, KVPlaneError
from kvplane.store.errors import (
    InvalidKey, InvalidParams, NoAvailableHandle, ObjectExists, ObjectHasLease, ObjectNotFound, ReplicaNotReady,
    SegmentExists,
)
from kvplane.store.master.allocator import OffsetAllocator
from kvplane.store.master.config import MasterConfig
from kvplane.store.types import MAX_KEY, MAX_VALUE, KeyResult, Replica, ReplicateConfig, SegmentInfo


@dataclass
class Segment:
    info: SegmentInfo
    alloc: OffsetAllocator

    def replica(self, off: int, size: int) -> Replica:
        return Replica(self.info.name, self.info.base + off, size, self.info.endpoint,
                       self.info.host_id)


@dataclass
class Obj:
    size: int
    replicas: list[tuple[str, int]]  # (segment, offset)
    complete: bool
    started: float
    lease_until: float = 0.0
    hard_pin: bool = False
    soft_pin_until: float = 0.0
    soft_pin_ttl: float = 0.0
    owner: str = ""  # client id of the put that made it (Mooncake's metadata.client_id)


@dataclass
class Client:
    last_seen: float
    segments: set[str] = field(default_factory=set)


class MasterState:
    """All store metadata. See the module docstring for the threading and clock contract."""

    def __init__(self, config: MasterConfig | None = None, seed: int = 0) -> None:
        self.config = config or MasterConfig()
        self.rng = random.Random(seed)
        self.objects: OrderedDict[str, Obj] = OrderedDict()  # LRU order: oldest first
        self.segments: dict[str, Segment] = {}
        self.clients: dict[str, Client] = {}
        self.graveyard: list[tuple[float, str, int]] = []  # (free_after, segment, offset)
        self._held: dict[tuple[str, int], int] = {}  # graveyard block -> bytes
        self.view_version = 1
        self.evicted = 0
        self.alloc_failures = 0
        self.changes: list[tuple[str, str]] = []  # ("stored"|"removed", key), drained by the server

    # -- clients and segments ----------------------------------------------------------------
    def mount(self, client_id: str, segs: list[SegmentInfo], now: float) -> None:
        """Register a client's segments (a remount of its own segments is accepted).

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
            self.segments[info.name] = Segment(info, OffsetAllocator(info.size))
            client.segments.add(info.name)

    def unmount(self, name: str) -> int:
        """Drop a segment and every replica on it; returns objects lost entirely."""
        seg = self.segments.pop(name, None)
        if seg is None:
            return 0
        client = self.clients.get(seg.info.client_id)
        if client:
            client.segments.discard(name)
        self.graveyard = [g for g in self.graveyard if g[1] != name]
        self._held = {k: v for k, v in self._held.items() if k[0] != name}
        lost = 0
        for key in list(self.objects):
            obj = self.objects[key]
            keep = [r for r in obj.replicas if r[0] != name]
            if len(keep) != len(obj.replicas):
                obj.replicas = keep
                if not keep:
                    del self.objects[key]
                    if obj.complete:
                        self.changes.append(("removed", key))
                    lost += 1
        return lost

    def ping(self, client_id: str, now: float) -> str:
        """Heartbeat: "ok", or "need_remount" for a client this master does not know."""
        client = self.clients.get(client_id)
        if client is None:
            return "need_remount"
        client.last_seen = now
        return "ok"

    def expire_clients(self, now: float) -> list[str]:
        """Unmount the segments of clients silent for longer than the TTL."""
        dead = [cid for cid, c in self.clients.items()
                if now - c.last_seen > self.config.client_ttl]
        for cid in dead:
            for name in list(self.clients[cid].segments):
                self.unmount(name)
            del self.clients[cid]
        return dead

    # -- writes ----------------------------------------------------------------------------------
    def put_start(self, key: str, size: int, cfg: ReplicateConfig, now: float,
                  upsert: bool = False, local_segments: frozenset[str] = frozenset()) -> KeyResult:
        """Allocate replicas for a new object; it stays invisible until put_end.

        Returns a KeyResult with code 0 and the replicas, or a negative error code.
        """
        try:
            self._check_key(key)
            if not 0 < size <= MAX_VALUE:
                raise InvalidParams(f"object size {size} out of range")
            if cfg.replica_num < 1:
                raise InvalidParams("replica_num must be >= 1")
            pin = self._soft_pin_ttl(cfg)
            old = self.objects.get(key)
            kept_pin = old.soft_pin_until if old is not None and old.complete else 0.0
            if old is not None:
                if old.complete and not upsert:
                    raise ObjectExists(f"{key!r} exists")
                if not old.complete and now - old.started < self.config.put_discard_timeout:
                    raise ObjectExists(f"{key!r} is being written")
                self._drop(key, old, now)
            elif len(self.objects) >= self.config.max_keys:
                raise NoAvailableHandle("the master holds its maximum number of keys")
            replicas = self._place(size, cfg, now, local_segments)
        except KVPlaneError as exc:
            return KeyResult(exc.code)
        obj = Obj(size, replicas, False, now, hard_pin=cfg.with_hard_pin, soft_pin_ttl=pin,
                  soft_pin_until=kept_pin if cfg.pin_action() == "preserve" else 0.0)
        self.objects[key] = obj
        return KeyResult(0, [self.segments[s].replica(o, size) for s, o in replicas], size)

    def put_end(self, key: str, now: float) -> int:
        """Make a written object visible (0, or an error code)."""
        obj = self.objects.get(key)
        if obj is None:
            return ObjectNotFound.code
        if not obj.complete:
            obj.complete = True
            self.changes.append(("stored", key))
            if obj.soft_pin_ttl:
                obj.soft_pin_until = now + obj.soft_pin_ttl
            self.objects.move_to_end(key)
        return 0

    def put_revoke(self, key: str, now: float) -> int:
        """Abandon an unfinished put and free its space."""
        obj = self.objects.get(key)
        if obj is None or obj.complete:
            return ObjectNotFound.code
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
        return KeyResult(0, [self.segments[s].replica(o, obj.size) for s, o in obj.replicas],
                         obj.size)

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
        """Free graveyard space whose leases ran out and puts abandoned past the release timeout."""
        due = [g for g in self.graveyard if g[0] <= now]
        self.graveyard = [g for g in self.graveyard if g[0] > now]
        for _, seg, off in due:
            self._held.pop((seg, off), None)
            if seg in self.segments:
                self.segments[seg].alloc.free(off)
        stale = [k for k, o in self.objects.items()
                 if not o.complete and now - o.started > self.config.put_release_timeout]
        for k in stale:
            self._drop(k, self.objects[k], now)
        return len(due) + len(stale)

    def objects_size_of(self, grave: tuple[float, str, int]) -> int:
        """Bytes held by one graveyard entry."""
        return self._held.get((grave[1], grave[2]), 0)

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
        held = sum(self.objects_size_of(g) for g in self.graveyard)
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
                if (obj.soft_pin_until > now) != soft_pass:
                    continue
                freed += obj.size * len(obj.replicas)
                self._drop(key, obj, now)
                count += 1
        self.evicted += count
        return count

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
        obj.replicas = [r for r in obj.replicas if r[0] not in segments]
        for seg, off in gone:
            if seg not in self.segments:
                continue
            if obj.lease_until > now:
                self.graveyard.append((obj.lease_until, seg, off))
                self._held[(seg, off)] = obj.size
            else:
                self.segments[seg].alloc.free(off)
        return len(gone)

    def _drop(self, key: str, obj: Obj, now: float) -> None:
        """Forget an object; space under a live lease is freed only once the lease ends."""
        self.objects.pop(key, None)
        if obj.complete:
            self.changes.append(("removed", key))
        for seg, off in obj.replicas:
            if seg not in self.segments:
                continue
            if obj.lease_until > now:
                self.graveyard.append((obj.lease_until, seg, off))
                self._held[(seg, off)] = obj.size
            else:
                self.segments[seg].alloc.free(off)

    def _candidates(self, cfg: ReplicateConfig, local: frozenset[str]) -> list[str]:
        names = list(self.segments)
        if not names:
            return []
        pref = [p for p in ([cfg.preferred_segment] if cfg.preferred_segment else [])
                + cfg.preferred_segments if p in self.segments]
        if cfg.prefer_alloc_in_same_node:
            pref += [n for n in names if n in local]
        start = self.rng.randrange(len(names))
        rest = names[start:] + names[:start]
        if self.config.allocation_strategy == "free_ratio_first":
            rest.sort(key=lambda n: -self.segments[n].alloc.free_bytes / self.segments[n].alloc.capacity)
        seen: set[str] = set()
        return [n for n in pref + rest if not (n in seen or seen.add(n))]  # type: ignore[func-returns-value]

    def _place(self, size: int, cfg: ReplicateConfig, now: float,
               local: frozenset[str]) -> list[tuple[str, int]]:
        for attempt in range(3):
            got: list[tuple[str, int]] = []
            for name in self._candidates(cfg, local):
                off = self.segments[name].alloc.allocate(size)
                if off is not None:
                    got.append((name, off))
                    if len(got) == cfg.replica_num:
                        break
            if got:  # best effort: at least one replica
                return got
            self.alloc_failures += 1
            if attempt == 0 and self.graveyard:
                # Out of room: first reuse the space of force-removed objects whose read leases
                # have not ended (``force`` accepted that such a reader may see new bytes, and
                # Mooncake frees it at once), before evicting anything still live.
                for _, seg, off in self.graveyard:
                    if seg in self.segments:
                        self.segments[seg].alloc.free(off)
                self.graveyard = []
                self._held.clear()
            elif attempt <= 1:
                self.evict(now, need=size * cfg.replica_num)
            else:
                break
        raise NoAvailableHandle(
            f"no segment has {size} free bytes; consider mounting more segments or lowering "
            "the eviction high watermark")
