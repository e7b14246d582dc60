"""The segment host's side of a sharded pool: one fence lane and one re-registration per shard.

A client that contributes a segment to a sharded pool mounts a share of it with every shard
(``session.py``). Each shard is a master of its own, with its own epoch: the segment's fence
keeps a floor per shard (lane = shard id, ``kvplane.transfer.fence``), so a shard that restarts
or fails over refuses its own old generations without touching the other shards'. When a shard
asks this host to mount again, only that shard's share is scanned and its records re-registered
with it (``Holdings.register``); a record whose key that shard does not serve by the map (its
slot belongs to another shard) is cleared rather than sent.

Built from the client's context and its ``ShardedLink``; imports the host package's
``adoption`` and the shard package.
"""

from __future__ import annotations

import logging

import numpy as np

from kvplane.common.deadline import Deadline
from kvplane.store import inventory
from kvplane.store.client.context import ClientContext
from kvplane.store.errors import WrongShard
from kvplane.store.host.adoption import Holdings
from kvplane.store.shard.link import ShardedLink
from kvplane.store.shard.shares import ShardedMountRep, ShardMount
from kvplane.store.shard.slots import OUT, OWN, ShardMap, SlotTable, slot_of_internal
from kvplane.store.types import AdoptReq, MountRep, SegmentInfo
from kvplane.transfer.fence import epoch_of

log = logging.getLogger(__name__)
TRIES = 3  # registrations of one share started over after a redirect (a newer map)


class ShardedHoldings(Holdings):
    """The records of one client's segment, kept per shard (see the module docstring).

    Args:
        ctx: the client's context (its ``rpc`` is ``link``).
        link: the client's link to the shards.
    """

    def __init__(self, ctx: ClientContext, link: ShardedLink) -> None:
        super().__init__(ctx)
        self.link = link

    def mounted(self, rep: MountRep) -> None:
        """Apply a sharded mount answer: each shard's epoch on its lane, then re-register the
        share of every shard that knew this segment before (its history is not new)."""
        if not isinstance(rep, ShardedMountRep):
            super().mounted(rep)
            return
        if rep.secret:
            self.secret = rep.secret
        fence = self._c.engine.fence
        for gone in rep.dropped:  # a shard that left: none of its generations lands again
            fence.set_epoch(0, lane=gone)
        for addr, length, keep in rep.clears:  # ranges that changed hands
            self._clear(addr, length, keep)
        for p in rep.parts:
            if p.rep.epoch > 0 and p.shares:
                fence.set_epoch(p.rep.epoch, p.rep.floor, lane=p.shard)
        self.history = [e for p in rep.parts for e in p.history][-64:]
        again = [p for p in rep.parts if p.register and p.shares and p.rep.epoch > 0]
        if again:
            self._drain()
        for p in again:
            for addr, length in p.clear:
                self._clear(addr, length)
            self._register_shard(p)

    def _clear(self, addr: int, length: int, keep: int = 0) -> None:
        """Clear the headers in ``[addr, addr + length)`` (space that came from a shard's
        share that ended: no record of it describes a live object), except those of epoch
        ``keep`` (the shard the space went to may have placed objects there already)."""
        mem = np.frombuffer(self._c.engine.memory.view(addr, length), np.uint8)
        for off in inventory.candidates(mem):
            rec = inventory.parse(mem, off, self.secret)
            if not keep or rec is None or epoch_of(rec.gen) != keep:
                inventory.invalidate(mem, off)

    def share_memory(self, share: SegmentInfo) -> np.ndarray:
        """The bytes of one share of the contributed segment."""
        return np.frombuffer(self._c.engine.memory.view(share.base, share.size), np.uint8)

    def _register_shard(self, part: ShardMount) -> None:
        # the records kept are those the map gives this shard, and a record not kept is
        # cleared: the map must be at least the shard's own (a stale one would clear records
        # of slots that moved to it), so the shard is asked first (it answers once it checked
        # its own with the other shards)
        self.link.install(self.link.call_shard(part.shard, "shard_map", "", ShardMap,
                                               Deadline.after(self._c.config.timeout)))
        for share in part.shares:
            for attempt in range(TRIES):
                try:
                    self._register_share(part, share)
                    break
                except WrongShard as exc:  # our map is older than the shard's: fetch, redo
                    log.info("shard %s redirected a re-registration: %s", part.shard, exc)
                    self.link.refresh(Deadline.after(self._c.config.timeout), part.shard)
                    if attempt == TRIES - 1:
                        raise

    def _register_share(self, part: ShardMount, share: SegmentInfo) -> None:
        table = SlotTable(self.link.map, part.shard)

        def keep(rec: inventory.Record) -> bool:
            return table.state[slot_of_internal(rec.key)] in (OWN, OUT)

        def adopt(req: AdoptReq) -> list[int]:
            return self.link.call_shard(part.shard, "adopt", req, list[int],
                                        Deadline.after(self._c.config.timeout))
        self.register(self.share_memory(share), share.name, part.history, adopt, keep)
