"""Mover: moves hash slots between the shards of a running pool, and adds or removes shards.

The mover is a store client of the pool (no segment of its own): it reads the newest map from
every shard, and moves slots in batches (``batch`` slots at most, from one source to one
target), each batch as ``move_rpc.py`` describes:

1. a map listing the batch as moving, installed on the source and the target first (each
   checked against the epoch the mover saw: a shard that restarted meanwhile stops the move),
   then on the others;
2. the source's open puts of those slots drain (at most ``DRAIN`` seconds), then the source
   freezes them and lists their objects under read leases;
3. every object is read from a replica and put into the target under its internal key, with
   its checksum, replica count and pin (``COPY`` objects per round);
4. a map giving the slots to the target, installed on the source first (it redirects from then
   on), then the target, then the others;
5. the source drops what it no longer owns.

A batch that fails at any step is undone: a map giving the slots back to the source, and the
target drops what it had imported. A mover that died mid-batch leaves the slots listed as
moving (writes to them wait): ``abort_moves`` undoes every such move.

Bytes flow from the source's segments through the mover to the target's shares (the mover's
memory, not the masters'). Adding a shard first lists it in the map (every segment host then
gives it a share: ``session.py``), then moves an equal part of every other shard's slots to
it; removing one moves all its slots to the others, then drops it from the map.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from kvplane.common.deadline import Deadline
from kvplane.common.errors import InvalidArgument, KVPlaneError
from kvplane.store.client import replica_io
from kvplane.store.client.client import StoreClient
from kvplane.store.errors import ObjectExists, TransferFail
from kvplane.store.shard.link import ShardedLink
from kvplane.store.shard.messages import (
    Exported,
    ExportRep,
    ExportReq,
    ImportEndReq,
    ImportReq,
    ReleaseReq,
    SetMapReq,
)
from kvplane.store.shard.slots import Move, ShardInfo, ShardMap, owners, ranges, reassign
from kvplane.store.types import CodesRep, ResultsRep

log = logging.getLogger(__name__)
DRAIN = 3.0  # seconds the source's open puts of a batch get to end
COPY = 64  # objects read and written per round
SHARES_WAIT = 15.0  # seconds a new shard waits for every segment to give it a share


@dataclass
class MoveReport:
    """What a move did."""

    slots: int = 0
    objects: int = 0
    bytes: int = 0
    batches: int = 0
    aborted: int = 0  # batches undone (and retried)
    seconds: float = 0.0
    versions: list[int] = field(default_factory=list)  # the maps installed


class Mover:
    """Moves slots between the shards of the pool at ``address`` (any shard's). Blocking; one
    mover per pool at a time.

    Args:
        address: a shard's master address.
        token: the service (or admin) token (None: the client's default, ``StoreConfig``).
        timeout: deadline of each step, seconds.
        batch: slots moved per batch.
        tries: attempts of a batch (an attempt undone by a shard that restarted is retried).
    """

    def __init__(self, address: str, token: str | None = None, timeout: float = 10.0,
                 batch: int = 256, tries: int = 3) -> None:
        opts: dict[str, Any] = {"master": address, "global_segment_size": 0,
                                "local_buffer_size": 64 << 20, "timeout": timeout,
                                "checksum": True, "location_cache": 0, "protocol": "tcp"}
        if token is not None:
            opts["token"] = token
        self.client = StoreClient(**opts)
        if not isinstance(self.client.rpc, ShardedLink):
            self.client.close()
            raise InvalidArgument(f"the master at {address} is not a shard of a sharded pool")
        self.link: ShardedLink = self.client.rpc
        self.timeout, self.batch, self.tries = timeout, batch, tries
        self.id = f"mover-{secrets.token_hex(4)}"

    # -- maps --------------------------------------------------------------------------------
    def newest(self) -> ShardMap:
        """The newest map any shard has."""
        self.link.refresh(self._deadline())
        return self.link.map

    def _deadline(self) -> Deadline:
        return Deadline.after(self.timeout)

    def push(self, new: ShardMap, first: list[int], expect: dict[int, int] | None = None,
             also: list[int] | None = None) -> None:
        """Install ``new`` on ``first`` in that order (each must take it, checked against its
        epoch in ``expect``), then on every other shard of it (and ``also``) that answers."""
        expect = expect or {}
        listed = {s.id: s for s in new.shards}
        for sid in first:
            self.link.call_shard(sid, "shard_set_map", SetMapReq(new, expect.get(sid, 0)), int,
                                 self._deadline(), info=listed.get(sid))
        rest = [s for s in sorted(set(new.ids()) | set(also or [])) if s not in first]
        if rest:
            self.link.each("shard_set_map", lambda _s: SetMapReq(new), int, self._deadline(),
                           shards=rest, tolerant=True)
        self.link.install(new)

    def epoch(self, sid: int) -> int:
        return self.link.call_shard(sid, "shard_epoch", "", int, self._deadline())

    # -- moves -------------------------------------------------------------------------------------
    def move(self, slots: list[int], target: int) -> MoveReport:
        """Move ``slots`` to shard ``target`` (those it owns already stay)."""
        t0 = time.monotonic()
        report = MoveReport()
        m = self.newest()
        m.shard(target)
        own = owners(m)
        by_source: dict[int, list[int]] = {}
        for s in slots:
            if own[s] != target:
                by_source.setdefault(own[s], []).append(s)
        for source, mine in sorted(by_source.items()):
            mine.sort()
            for i in range(0, len(mine), self.batch):
                self._batch(source, target, ranges(mine[i:i + self.batch]), report)
        report.seconds = time.monotonic() - t0
        return report

    def _batch(self, source: int, target: int, rngs: list[tuple[int, int]],
               report: MoveReport) -> None:
        for attempt in range(self.tries):
            try:
                self._attempt(source, target, rngs, report)
                report.batches += 1
                report.slots += sum(e - f for f, e in rngs)
                return
            except KVPlaneError as exc:
                report.aborted += 1
                log.warning("moving %d slots %s -> %s failed (try %d): %s; undoing",
                            sum(e - f for f, e in rngs), source, target, attempt + 1, exc)
                self._undo(source, target, rngs)
                if attempt == self.tries - 1:
                    raise

    def _attempt(self, source: int, target: int, rngs: list[tuple[int, int]],
                 report: MoveReport) -> None:
        m = self.newest()
        e_src, e_dst = self.epoch(source), self.epoch(target)
        expect = {source: e_src, target: e_dst}
        moving = ShardMap(m.version + 1, m.shards, m.runs,
                          m.moving + [Move(f, e, source, target) for f, e in rngs])
        self.push(moving, [source, target], expect)
        report.versions.append(moving.version)
        drain = Deadline.after(DRAIN)
        while self._export(source, rngs, False, e_src).pending and not drain.expired():
            time.sleep(0.01)
        self._copy(source, rngs, e_src, target, e_dst, report)
        done = reassign(moving, [s for f, e in rngs for s in range(f, e)], target,
                        moving=[mv for mv in moving.moving
                                if (mv.first, mv.end) not in rngs or mv.source != source])
        self.push(done, [source], expect)  # the source redirects from now on: no way back
        report.versions.append(done.version)
        self._finish(done, source, target, rngs)

    def _finish(self, done: ShardMap, source: int, target: int,
                rngs: list[tuple[int, int]]) -> None:
        """After the source gave the slots up: the target must take them (retried: even a
        target that restarted meanwhile finds the moved objects again, as its segments
        re-register them under the map that gives it the slots), then the source drops its
        copies."""
        deadline = Deadline.after(3 * self.timeout)
        while True:
            try:
                self.push(done, [target])
                break
            except KVPlaneError as exc:
                if deadline.expired():
                    raise
                log.warning("shard %s did not take map v%s yet: %s", target, done.version, exc)
                time.sleep(0.2)
        try:
            self.link.call_shard(source, "shard_release", ReleaseReq(rngs), int,
                                 self._deadline())
        except KVPlaneError as exc:  # its copies stay until a later release: space, not data
            log.warning("shard %s did not drop the moved objects yet: %s", source, exc)

    def _export(self, source: int, rngs: list[tuple[int, int]], freeze: bool,
                epoch: int) -> ExportRep:
        return self.link.call_shard(source, "shard_export", ExportReq(rngs, freeze, epoch),
                                    ExportRep, self._deadline())

    def _copy(self, source: int, rngs: list[tuple[int, int]], e_src: int, target: int,
              e_dst: int, report: MoveReport) -> None:
        """Freeze the slots on the source, then read each object and put it into the target;
        the source is asked again (renewing the read leases) when they are about to end."""
        sent = time.monotonic()
        rep = self._export(source, rngs, True, e_src)
        objs, lease_end = rep.objects, sent + rep.ttl
        for i in range(0, len(objs), COPY):
            if time.monotonic() >= lease_end - max(1.0, rep.ttl / 4):
                sent = time.monotonic()
                again = self._export(source, rngs, True, e_src)
                lease_end = sent + again.ttl
                fresh = {o.key: o for o in again.objects}
                objs = objs[:i] + [fresh[o.key] for o in objs[i:] if o.key in fresh]
            self._copy_round(objs[i:i + COPY], lease_end, target, e_dst, report)

    def _copy_round(self, objs: list[Exported], lease_end: float, target: int, epoch: int,
                    report: MoveReport) -> None:
        ctx = self.client.context
        sizes = [o.result.size for o in objs]
        deadline = self._deadline()
        with ctx.staging.block(sum(sizes) or 1) as (base, _view):
            addrs, at = [], base
            for n in sizes:
                addrs.append(at)
                at += n
            got = replica_io.read(ctx, [o.result for o in objs], addrs, sizes, deadline,
                                  lease_end)
            bad = [o.key for o, n in zip(objs, got) if n < 0]
            if bad:
                raise TransferFail(f"could not read {len(bad)} objects to move ({bad[:3]})")
            started = self.link.call_shard(target, "shard_import", ImportReq(
                self.id, [o.key for o in objs], sizes, [o.result.checksum for o in objs],
                [o.want for o in objs], [o.hard_pin for o in objs], self.timeout,
                secrets.randbits(62), epoch), ResultsRep, deadline)
            ok = [j for j, r in enumerate(started.results) if r.code == 0]
            errors = [r.code for r in started.results if r.code not in (0, ObjectExists.code)]
            if errors:
                raise TransferFail(f"the target refused {len(errors)} objects (codes "
                                   f"{sorted(set(errors))})")
            failed = replica_io.put_write(ctx, started.results, ok, addrs, sizes, deadline,
                                          blame_failed=False)
            if failed:
                raise TransferFail(f"could not write {len(failed)} moved objects")
            ended = self.link.call_shard(target, "shard_import_end", ImportEndReq(
                [objs[j].key for j in ok], [started.results[j].version for j in ok],
                [objs[j].result.checksum for j in ok], epoch), CodesRep, deadline)
            if any(ended.codes):
                raise TransferFail(f"the target did not commit {sum(map(bool, ended.codes))} "
                                   "moved objects")
        report.objects += len(ok)
        report.bytes += sum(sizes[j] for j in ok)

    def _undo(self, source: int, target: int, rngs: list[tuple[int, int]]) -> None:
        """Give the slots back to the source and drop what the target imported. Only before
        the source gave them up: the target never served them (it refused them as moving in),
        so it is told when it answers; a target that does not is told by the next map it
        fetches, and its segments clear what it had imported."""
        m = self.newest()
        slots = [s for f, e in rngs for s in range(f, e)]
        back = reassign(m, slots, source, moving=[
            mv for mv in m.moving if not (mv.source == source and mv.target == target
                                          and (mv.first, mv.end) in rngs)])
        self.push(back, [source])
        try:
            self.link.call_shard(target, "shard_release", ReleaseReq(rngs), int,
                                 self._deadline())
        except KVPlaneError as exc:
            log.warning("shard %s did not drop what it imported: %s", target, exc)

    def sync(self) -> ShardMap:
        """Install the newest map on every shard that answers (after a mover died between
        two installs)."""
        m = self.newest()
        self.push(m, [])
        return m

    def abort_moves(self) -> int:
        """Undo every move the newest map lists (a mover died mid-batch); returns how many."""
        m = self.newest()
        for mv in list(m.moving):
            self._undo(mv.source, mv.target, [(mv.first, mv.end)])
        return len(m.moving)

    # -- shards ------------------------------------------------------------------------------------
    def add_shard(self, info: ShardInfo) -> MoveReport:
        """List shard ``info`` in the map, wait until every segment gave it a share, and move
        it an equal part of every other shard's slots."""
        m = self.newest()
        if info.id in m.ids():
            raise InvalidArgument(f"shard {info.id} is in the map already")
        grown = ShardMap(m.version + 1, m.shards + [info], m.runs, m.moving)
        self.push(grown, [info.id])
        self._wait_for_shares(info.id)
        own = owners(grown)
        fair = len(own) // len(grown.shards)
        take: list[int] = []
        for sid in m.ids():
            mine = [s for s in range(len(own)) if own[s] == sid]
            extra = max(0, len(mine) - fair)
            take += mine[len(mine) - extra:]  # its last slots: its runs stay whole
        return self.move(take, info.id)

    def _wait_for_shares(self, sid: int) -> None:
        """Until the new shard has as many segments as the others (or ``SHARES_WAIT``)."""
        deadline = Deadline.after(SHARES_WAIT)
        while not deadline.expired():
            counts = self._segment_counts()
            if counts and counts.get(sid, 0) >= max(counts.values()):
                return
            time.sleep(0.1)
        log.warning("shard %s has shares of fewer segments than the others", sid)

    def _segment_counts(self) -> dict[int, int]:
        from kvplane.store.shard.messages import StatusReq
        got = self.link.each("shard_status", lambda _s: StatusReq(), dict[str, Any],
                             self._deadline(), tolerant=True)
        return {sid: len(doc["segments"]) for sid, doc in got.items()}

    def remove_shard(self, sid: int) -> MoveReport:
        """Move every slot of shard ``sid`` to the others (evenly), then drop it from the map."""
        m = self.newest()
        others = [s for s in m.ids() if s != sid]
        if not others:
            raise InvalidArgument("the last shard cannot be removed")
        own = owners(m)
        mine = [s for s in range(len(own)) if own[s] == sid]
        total = MoveReport()
        step = -(-len(mine) // len(others))
        for i, target in enumerate(others):
            part = self.move(mine[i * step:(i + 1) * step], target)
            for name in ("slots", "objects", "bytes", "batches", "aborted"):
                setattr(total, name, getattr(total, name) + getattr(part, name))
            total.versions += part.versions
            total.seconds += part.seconds
        m = self.newest()
        smaller = ShardMap(m.version + 1, [s for s in m.shards if s.id != sid], m.runs,
                           m.moving)
        self.push(smaller, others, also=[sid])
        total.versions.append(smaller.version)
        return total

    def close(self) -> None:
        """Close the mover's client (idempotent)."""
        self.client.close()

    def __enter__(self) -> Mover:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
