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
from kvplane.store.errors import NotLeader
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

    # -- mount -----------------------------------------------------------------------------------
    def share(self, info: Any, shard: int) -> Any:
        """The part of segment ``info`` (a ``SegmentInfo``) that ``shard`` allocates in."""
        cut = self.layout.setdefault(info.name, even(info.size, self.link.map.ids()))
        off, size = cut[shard]
        return msgspec.structs.replace(info, base=info.base + off, size=size)

    def due(self) -> list[int]:
        """The shards to mount now: never mounted, or asking for it."""
        return [s for s in self.link.map.ids() if s not in self.mounted or s in self.remount]

    def mount(self, req: MountReq, deadline: Deadline, once: bool) -> MountRep:
        """Mount ``req``'s segments with every shard that is due, each with its share."""
        todo = self.due() if req.segments else self.link.map.ids()

        def ask(shard: int) -> MountReq:
            hist = self.history.get(shard, []) if req.segments else []
            return MountReq(req.client_id, [self.share(s, shard) for s in req.segments], hist,
                            adopt=bool(req.segments and hist))
        asked = {s: ask(s) for s in todo}
        got = self.link.each("mount", asked.__getitem__, MountRep, deadline, once, shards=todo)
        parts = []
        for shard in todo:
            rep = got[shard]
            sub = self.link.link(shard)
            if sub.ha and rep.epoch < sub.term:  # a deposed leader never takes a share back
                raise NotLeader(f"shard {shard}: a master of term {rep.epoch} answered after "
                                f"term {sub.term}")
            sub.saw_epoch(rep.epoch)
            hist = asked[shard].history
            if req.segments and rep.epoch > 0:
                if not hist or hist[-1] != rep.epoch:
                    self.history[shard] = (hist + [rep.epoch])[-HISTORY:]
                self.epochs[rep.epoch] = shard
            parts.append(ShardMount(shard, rep, asked[shard].segments,
                                    self.history.get(shard, []), fresh=not hist))
            self.mounted.add(shard)
            self.remount.discard(shard)
        first = got[todo[0]] if todo else MountRep(0)
        return ShardedMountRep(first.epoch, first.floor, first.secret, first.tenants,
                               first.tenant, parts=parts)

    def unmount(self, req: MountReq, deadline: Deadline, once: bool) -> int:
        """Unmount ``req``'s segments from every shard (their shares); shards that cannot be
        reached are skipped (their TTL unmounts them)."""
        asked = {s: MountReq(req.client_id, [self.share(g, s) for g in req.segments])
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
        out = PingRep("ok", 0)
        for shard, rep in got.items():
            if rep.status == "need_remount":
                self.remount.add(shard)
            out.view_version += rep.view_version
            out.fences += rep.fences
            out.repairs += rep.repairs
            out.forgets += rep.forgets
        if self.remount or (self.mounted and self.due()):
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
