"""The master's SSD-tier RPCs: ``disk_sync``, ``disk_adopt``, ``promote_start``, ``promote_end``.

Thin handlers over ``MasterState.tiers`` (``tiers.py``), each run under the server's state
lock like every other handler. Only the pool's own segment processes may call them (the default
tenant: a tenant token is refused), and the master acts on the calling client's segments only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvplane.common import metrics
from kvplane.common.auth import DEFAULT_TENANT
from kvplane.common.errors import Unauthorized
from kvplane.common.rpc import current_principal
from kvplane.store.errors import SegmentNotFound
from kvplane.store.tier_types import (
    DiskAdoptReq, DiskSyncRep, DiskSyncReq, PromoteEndReq, PromoteRep, PromoteReq, PromoteTask,
)

if TYPE_CHECKING:
    from kvplane.store.master.server import MasterServer
    from kvplane.store.master.state import MasterState


PENDING = metrics.Gauge("master_offloads_pending", "Objects whose copy to an SSD tier is under way")
OFFLOADED = metrics.Gauge("master_offloaded_replicas", "Disk copies made by SSD tiers (since start)")
DEMOTED = metrics.Gauge("master_demoted_objects", "Evictions that kept the object on disk (since start)")
PROMOTED = metrics.Gauge("master_promoted_replicas", "Disk copies read back into memory (since start)")


def gauges(state: "MasterState") -> None:
    """Refresh the SSD-tier gauges (the server's timer, under its lock)."""
    tiers = state.tiers
    PENDING.set(len(tiers.offloads))
    OFFLOADED.set(tiers.offloaded)
    DEMOTED.set(tiers.demoted)
    PROMOTED.set(tiers.promoted)


def _service_only(method: str, fn: Any) -> Any:
    """Only the pool's own segment processes (the default tenant) speak for a disk."""
    def guarded(req: Any) -> Any:
        if current_principal().tenant != DEFAULT_TENANT:
            raise Unauthorized(f"{method} is for the pool's own segment processes")
        return fn(req)
    return guarded


class TierRpc:
    """Installs the SSD-tier handlers on a ``MasterServer``."""

    def __init__(self, server: "MasterServer") -> None:
        self._srv = server

    def install(self) -> None:
        for name, fn, typ in (
            ("disk_sync", self._sync, DiskSyncReq), ("disk_adopt", self._adopt, DiskAdoptReq),
            ("promote_start", self._promote_start, PromoteReq),
            ("promote_end", self._promote_end, PromoteEndReq),
        ):
            self._srv.add_handler(name, _service_only(name, fn), typ)

    def _segments(self, client_id: str) -> set[str]:
        client = self._srv.state.clients.get(client_id)
        return set(client.segments) if client is not None else set()

    def _sync(self, req: DiskSyncReq) -> DiskSyncRep:
        st = self._srv.state
        now = self._srv.clock()
        mine = self._segments(req.client_id)
        if not mine:
            return DiskSyncRep()
        seg = sorted(mine)[0]
        taken = [st.tiers.offload_done(seg, r.key, r.version, r.ok, r.path) for r in req.done]
        for key, version in req.lost:
            st.tiers.lost(seg, key, version, now)
        return DiskSyncRep(st.tiers.take(mine), st.tiers.forgets_for(mine), taken)

    def _adopt(self, req: DiskAdoptReq) -> list[int]:
        st = self._srv.state
        seg = st.segments.get(req.segment)
        if seg is None or seg.info.client_id != req.client_id:
            raise SegmentNotFound(f"segment {req.segment!r} is not mounted by this client")
        return st.tiers.adopt(seg, req.records, req.paths, req.history, self._srv.clock())

    def _promote_start(self, req: PromoteReq) -> PromoteRep:
        st = self._srv.state
        now = self._srv.clock()
        mine = self._segments(req.client_id)
        if not mine:
            return PromoteRep([PromoteTask(SegmentNotFound.code) for _ in req.keys])
        seg = sorted(mine)[0]
        return PromoteRep([st.tiers.promote_start(seg, k, v, now)
                           for k, v in zip(req.keys, req.versions, strict=True)])

    def _promote_end(self, req: PromoteEndReq) -> int:
        st = self._srv.state
        now = self._srv.clock()
        return sum(st.tiers.promote_end(k, g, ok, now)
                   for k, g, ok in zip(req.keys, req.gens, req.ok, strict=True))
