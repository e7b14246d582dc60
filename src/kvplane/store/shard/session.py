"""A client's session with every shard of a sharded pool: mounts, heartbeats, acknowledgements.

**Shares.** A segment host mounts each of its segments with every shard, each shard getting a
*share*: a contiguous part of the segment that only that shard allocates in (``shares``), so no
shard ever asks another for space. The master of a shard sees its share as a segment of the
segment's own name (the name is what clients open); the shares of one segment never overlap.
The shares of a segment are cut when it first mounts, equal, in shard-id order.

**Per shard.** Each shard has its own epoch (its own leader terms and restarts), so the session
keeps per shard the epochs it mounted with (the history that orders its records), and which
shards must be mounted again: a heartbeat answered ``need_remount`` by one shard (it restarted
or failed over) remounts that shard alone, and only its share is re-registered (``host.py``).
Generations carry their epoch, so fence and forget acknowledgements and repair reports go back
to the shard that issued them.

**Liveness.** A heartbeat goes to every shard at once; a shard that does not answer fails only
its own part (the others still hear from this client within their TTL).

Imports the shard package's link and pure parts and the store's wire types; binds nothing.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec

from kvplane.common.deadline import Deadline
from kvplane.common.errors import KVPlaneError
from kvplane.store.errors import NotLeader
from kvplane.store.shard.messages import ReshareRep, ReshareReq
from kvplane.store.shard.shares import ShardedMountRep, ShardMount, even
from kvplane.store.types import MountRep, MountReq, PingRep, PingReq, RepairDoneReq
from kvplane.transfer.fence import EPOCH_SHIFT

if TYPE_CHECKING:
    from kvplane.store.shard.link import ShardedLink

log = logging.getLogger(__name__)
HISTORY = 64  # epochs remembered per shard (as ``host.adoption.HISTORY``)


class HostSession:
    """The per-shard mount state of one client (see the module docstring). Called through its
    link's ``call`` (``mount``, ``ping``, ``unmount``, ``repair_done``); thread-safe as far as
    the client's own calls need (mounts and heartbeats come from one thread at a time).

    Args:
        link: the client's sharded link.
    """

    def __init__(self, link: ShardedLink) -> None:
        self.link = link
        self.layout: dict[str, dict[int, tuple[int, int]]] = {}  # segment -> shard -> share
        self.history: dict[int, list[int]] = {}  # shard -> epochs its mounts answered
        self.epochs: dict[int, int] = {}  # epoch -> the shard that answered with it
        self.mounted: set[int] = set()
        self.remount: set[int] = set()  # shards that answered a heartbeat "need_remount"
        self.holes: dict[str, list[tuple[int, int]]] = {}  # segment -> ranges no shard has
        self.clears: list[tuple[int, int, int]] = []  # (address, length, epoch kept) to clear

    # -- mount -----------------------------------------------------------------------------------
    def share(self, info: Any, shard: int) -> Any | None:
        """The part of segment ``info`` (a ``SegmentInfo``) that ``shard`` allocates in (None:
        it has none, as a shard that joined when the segment had no free space to give)."""
        cut = self.layout.setdefault(info.name, even(info.size, self.link.map.ids()))
        got = cut.get(shard)
        if got is None:
            return None
        return msgspec.structs.replace(info, base=info.base + got[0], size=got[1])

    def shares(self, segments: list[Any], shard: int) -> list[Any]:
        return [x for x in (self.share(g, shard) for g in segments) if x is not None]

    def due(self) -> list[int]:
        """The shards to mount now: never mounted, or asking for it."""
        return [s for s in self.link.map.ids() if s not in self.mounted or s in self.remount]

    def reshaped(self) -> bool:
        """True when the map's shards are not those the segments' shares were cut for."""
        ids = set(self.link.map.ids())
        return any(set(cut) != ids for cut in self.layout.values())

    def mount(self, req: MountReq, deadline: Deadline, once: bool) -> MountRep:
        """Mount ``req``'s segments with every shard that is due, each with its share (the
        shares re-cut first when shards joined or left the map: ``reshape``)."""
        parts, dropped = (self.reshape(req, deadline) if req.segments and self.reshaped()
                          else ([], []))
        todo = self.due() if req.segments else self.link.map.ids()

        def ask(shard: int) -> MountReq:
            hist = self.history.get(shard, []) if req.segments else []
            return MountReq(req.client_id, self.shares(req.segments, shard), hist,
                            adopt=bool(req.segments and hist))
        asked = {s: ask(s) for s in todo}
        got = self.link.each("mount", asked.__getitem__, MountRep, deadline, once, shards=todo)
        for shard in todo:
            hist = asked[shard].history
            rep = self._mounted(shard, got[shard], bool(req.segments))
            parts.append(ShardMount(shard, rep, asked[shard].segments,
                                    self.history.get(shard, []), register=bool(hist)))
        first = parts[0].rep if parts else MountRep(0)
        clears, self.clears = self.clears, []
        return ShardedMountRep(first.epoch, first.floor, first.secret, first.tenants,
                               first.tenant, parts=parts, dropped=dropped, clears=clears)

    def _mounted(self, shard: int, rep: MountRep, segments: bool) -> MountRep:
        """Take ``shard``'s mount answer: its epoch joins the shard's history."""
        sub = self.link.link(shard)
        if sub.ha and rep.epoch < sub.term:  # a deposed leader never takes a share back
            raise NotLeader(f"shard {shard}: a master of term {rep.epoch} answered after "
                            f"term {sub.term}")
        sub.saw_epoch(rep.epoch)
        if segments and rep.epoch > 0:
            hist = self.history.get(shard, [])
            if not hist or hist[-1] != rep.epoch:
                self.history[shard] = (hist + [rep.epoch])[-HISTORY:]
            self.epochs[rep.epoch] = shard
        self.mounted.add(shard)
        self.remount.discard(shard)
        return rep

    # -- re-cutting shares ---------------------------------------------------------------------
    def reshape(self, req: MountReq, deadline: Deadline) -> tuple[list[ShardMount], list[int]]:
        """Re-cut every segment's shares for the map's shards, in place (nothing moves): the
        share of a shard that left goes to the share before it, which grows (a first share
        stays unused, a *hole*, until a shard joins); a shard that joins gets a hole, else the
        free tail of the largest share, which shrinks. Returns the parts of the shards that
        joined (their shares cleared, then opened) and the shards that left (their fence lanes
        close); the ranges that changed hands are cleared of the left shards' headers."""
        ids = self.link.map.ids()
        parts: list[ShardMount] = []
        dropped: set[int] = set()
        for info in req.segments:
            cut = self.layout.setdefault(info.name, even(info.size, ids))
            holes = self.holes.setdefault(info.name, [])
            for gone in [s for s in cut if s not in ids]:
                dropped.add(gone)
                self._merge(req.client_id, info, cut, holes, gone, deadline)
            for new in [s for s in ids if s not in cut]:
                parts += self._carve(req.client_id, info, cut, holes, new, len(ids), deadline)
        for gone in dropped:  # (a shard still running lets go of this client's share)
            self._let_go(gone, req, deadline)
            self.mounted.discard(gone)
            self.remount.discard(gone)
            self.history.pop(gone, None)
        return parts, sorted(dropped)

    def _let_go(self, gone: int, req: MountReq, deadline: Deadline) -> None:
        try:
            self.link.link(gone).call("unmount", MountReq(req.client_id, [
                msgspec.structs.replace(g, size=1) for g in req.segments]), int, once=True,
                timeout=min(1.0, max(0.01, deadline.remaining())))
        except KVPlaneError as exc:
            log.debug("shard %s (left the map) did not unmount: %s", gone, exc)

    def _reshare(self, shard: int, client_id: str, info: Any, off: int, size: int,
                 shrink: bool, deadline: Deadline) -> ReshareRep:
        seg = msgspec.structs.replace(info, base=info.base + off, size=size)
        return self.link.call_shard(shard, "shard_reshare", ReshareReq(client_id, seg, shrink),
                                    ReshareRep, deadline)

    def _merge(self, client_id: str, info: Any, cut: dict[int, tuple[int, int]],
               holes: list[tuple[int, int]], gone: int, deadline: Deadline) -> None:
        off, size = cut.pop(gone)
        heir = next((s for s, (o, n) in cut.items() if o + n == off), None)
        if heir is None:
            holes.append((off, size))
            self.clears.append((info.base + off, size, 0))
            return
        o, n = cut[heir]
        rep = self._reshare(heir, client_id, info, o, n + size, False, deadline)
        cut[heir] = (o, rep.size)
        heir_epoch = self.history.get(heir, [0])[-1]  # headers of the heir's own stay
        self.clears.append((info.base + off, size, heir_epoch))

    def _carve(self, client_id: str, info: Any, cut: dict[int, tuple[int, int]],
               holes: list[tuple[int, int]], new: int, shards: int,
               deadline: Deadline) -> list[ShardMount]:
        if holes:
            holes.sort(key=lambda h: h[1])
            off, size = holes.pop()
        else:
            donor = max(cut, key=lambda s: cut[s][1])
            d_off, d_size = cut[donor]
            want = d_size - min(info.size // shards, d_size // 2)
            rep = self._reshare(donor, client_id, info, d_off, want, True, deadline)
            if rep.size >= d_size:  # no free tail to give now: the new shard waits
                return []
            cut[donor] = (d_off, rep.size)
            off, size = d_off + rep.size, d_size - rep.size
        got = self._reshare(new, client_id, info, off, size, False, deadline)
        cut[new] = (off, got.size)
        self._mounted(new, got.mount, True)
        share = msgspec.structs.replace(info, base=info.base + off, size=got.size)
        return [ShardMount(new, got.mount, [share], self.history.get(new, []), register=True,
                           clear=[(info.base + off, size)])]

    def unmount(self, req: MountReq, deadline: Deadline, once: bool) -> int:
        """Unmount ``req``'s segments from every shard (their shares); shards that cannot be
        reached are skipped (their TTL unmounts them)."""
        asked = {s: MountReq(req.client_id, self.shares(req.segments, s))
                 for s in self.link.map.ids()}
        self.link.each("unmount", asked.__getitem__, int, deadline, once, tolerant=True)
        return 0

    # -- heartbeat ---------------------------------------------------------------------------------
    def shard_of_gen(self, gen: int) -> int | None:
        """The shard whose epoch ``gen`` carries (None: not one this client mounted with)."""
        return self.epochs.get(gen >> EPOCH_SHIFT)

    def split(self, gens: list[int]) -> dict[int | None, list[int]]:
        """``gens`` by the shard that issued them."""
        out: dict[int | None, list[int]] = {}
        for g in gens:
            out.setdefault(self.shard_of_gen(g), []).append(g)
        return out

    def ping(self, req: PingReq, deadline: Deadline, once: bool) -> PingRep:
        """One heartbeat to every shard; the answers joined (``need_remount`` if any shard, or
        a shard this client never mounted with, says so)."""
        fenced, forgot = self.split(req.fenced), self.split(req.forgot)

        def ask(shard: int) -> PingReq:
            return PingReq(req.client_id, fenced.get(shard, []) + fenced.get(None, []),
                           req.suspects, forgot.get(shard, []) + forgot.get(None, []),
                           req.retired)
        got = self.link.each("ping", ask, PingRep, deadline, once, tolerant=True)
        if self.layout and got:  # a host: shards that join or leave re-cut its shares
            self.link.refresh(deadline, min(got), quick=True)
        out = PingRep("ok", 0)
        for shard, rep in got.items():
            if rep.status == "need_remount":
                self.remount.add(shard)
            out.view_version += rep.view_version
            out.fences += rep.fences
            out.repairs += rep.repairs
            out.forgets += rep.forgets
        if self.remount or (self.mounted and (self.due() or self.reshaped())):
            out.status = "need_remount"
        return out

    def repair_done(self, req: RepairDoneReq, deadline: Deadline, once: bool) -> int:
        """Report finished repairs to the shards that handed them out."""
        rows: dict[int, list[int]] = {}
        for i, g in enumerate(req.gens):
            shard = self.shard_of_gen(g)
            if shard is not None:
                rows.setdefault(shard, []).append(i)

        def ask(shard: int) -> RepairDoneReq:
            idx = rows[shard]
            return RepairDoneReq(req.client_id, [req.keys[i] for i in idx],
                                 [req.gens[i] for i in idx], [req.ok[i] for i in idx])
        got = self.link.each("repair_done", ask, int, deadline, once, shards=sorted(rows))
        return sum(got.values())
