"""The master's SSD-tier RPCs: ``disk_sync``, ``disk_adopt``, ``promote_start``, ``promote_end``.

Thin handlers over ``MasterState.tiers`` (``tiers.py``); ``handlers(serving)`` returns them for
the server to register (once, at start), each run under the server's state lock like every
other handler. Only the pool's own segment processes may call them (the default
tenant: a tenant token is refused), and the master acts on the calling client's segments only.

An RPC module: imports the state and the wire types; never the server.
"""

from __future__ import annotations

from typing import Any

from kvplane.common import metrics
from kvplane.common.auth import DEFAULT_TENANT
from kvplane.common.errors import Unauthorized
from kvplane.common.rpc import current_principal
from kvplane.store.errors import SegmentNotFound
from kvplane.store.master.serving import Handler, Handlers, Serving
from kvplane.store.master.state import MasterState
from kvplane.store.tier_types import (
    DiskAdoptReq,
    DiskSyncRep,
    DiskSyncReq,
    PromoteEndReq,
    PromoteRep,
    PromoteReq,
    PromoteTask,
)

PENDING = metrics.Gauge("master_offloads_pending", "Objects whose copy to an SSD tier is under way")
OFFLOADED = metrics.Gauge("master_offloaded_replicas", "Disk copies made by SSD tiers (since start)")
DEMOTED = metrics.Gauge("master_demoted_objects", "Evictions that kept the object on disk (since start)")
PROMOTED = metrics.Gauge("master_promoted_replicas", "Disk copies read back into memory (since start)")


def gauges(state: MasterState) -> None:
    """Refresh the SSD-tier gauges (the server's timer, under its lock)."""
    tiers = state.tiers
    PENDING.set(len(tiers.offloads))
    OFFLOADED.set(tiers.offloaded)
    DEMOTED.set(tiers.demoted)
    PROMOTED.set(tiers.promoted)


def _service_only(method: str, fn: Handler) -> Handler:
    """Only the pool's own segment processes (the default tenant) speak for a disk."""
    def guarded(req: Any) -> Any:
        if current_principal().tenant != DEFAULT_TENANT:
            raise Unauthorized(f"{method} is for the pool's own segment processes")
        return fn(req)
    return guarded


def handlers(serving: Serving) -> Handlers:
    """The SSD-tier RPCs, by method name, for the server to register (service callers only)."""
    rpc = TierRpc(serving)
    table: Handlers = {
        "disk_sync": (rpc.sync, DiskSyncReq), "disk_adopt": (rpc.adopt, DiskAdoptReq),
        "promote_start": (rpc.promote_start, PromoteReq),
        "promote_end": (rpc.promote_end, PromoteEndReq),
    }
    return {name: (_service_only(name, fn), typ) for name, (fn, typ) in table.items()}


class TierRpc:
    """The SSD-tier handlers over the served state.

    Args:
        serving: the state being served and the clock.
    """

    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    def sync(self, req: DiskSyncReq) -> DiskSyncRep:
        """Offload reports and lost copies in; new offload tasks and deletions out."""
        st = self.serving.state
        now = self.serving.clock()
        mine = st.segments_of(req.client_id)
        if not mine:
            return DiskSyncRep()
        seg = sorted(mine)[0]
        taken = [st.tiers.offload_done(seg, r.key, r.version, r.ok, r.path) for r in req.done]
        for key, version in req.lost:
            st.tiers.lost(seg, key, version, now)
        return DiskSyncRep(st.tiers.take(mine), st.tiers.forgets_for(mine), taken)

    def adopt(self, req: DiskAdoptReq) -> list[int]:
        """Re-register the disk copies a node holds (after a restart of either side)."""
        st = self.serving.state
        seg = st.segments.get(req.segment)
        if seg is None or seg.info.client_id != req.client_id:
            raise SegmentNotFound(f"segment {req.segment!r} is not mounted by this client")
        return st.tiers.adopt(seg, req.records, req.paths, req.history, self.serving.clock())

    def promote_start(self, req: PromoteReq) -> PromoteRep:
        """Allocate memory for disk copies the caller's node will read back in."""
        st = self.serving.state
        now = self.serving.clock()
        mine = st.segments_of(req.client_id)
        if not mine:
            return PromoteRep([PromoteTask(SegmentNotFound.code) for _ in req.keys])
        seg = sorted(mine)[0]
        return PromoteRep([st.tiers.promote_start(seg, k, v, now)
                           for k, v in zip(req.keys, req.versions, strict=True)])

    def promote_end(self, req: PromoteEndReq) -> int:
        """The promotions' outcomes; returns how many memory replicas joined."""
        st = self.serving.state
        now = self.serving.clock()
        return sum(st.tiers.promote_end(k, g, ok, now)
                   for k, g, ok in zip(req.keys, req.gens, req.ok, strict=True))
