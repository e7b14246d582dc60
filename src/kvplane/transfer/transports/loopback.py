"""Example transport (docs/transfer.md, "Adding a transport"): copies within this process.

Reaches the memory regions of any engine in this process: their published addresses are this
process's own, so a slice is one copy. Not registered by default; a test registers it.
"""

from __future__ import annotations

import os

from kvplane.common.deadline import Deadline
from kvplane.transfer.batch import Slice
from kvplane.transfer.jobs import Peer
from kvplane.transfer.memory import view_at
from kvplane.transfer.seam import Capabilities, Route, Transport, TransportContext
from kvplane.transfer.types import OpCode, RegionKind, TransferStatus


class LoopbackTransport(Transport):
    """memcpy to the regions of engines in this process (no fences: an example only)."""

    name = "loopback"
    capabilities = Capabilities(same_host_only=True, priority=0)

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self.fast = 0  # items served by the one-item capability

    def can_reach(self, route: Route) -> bool:
        return (route.segment.pid == os.getpid()
                and route.region.kind not in (RegionKind.FILE, RegionKind.DEVICE))

    def run(self, route: Route, slices: list[Slice], deadline: Deadline) -> None:
        for s in slices:
            if deadline.expired():
                s.done(TransferStatus.TIMEOUT, "deadline passed")
                continue
            _copy(s.op, s.local, s.remote)
            s.done(TransferStatus.COMPLETED)

    # OneItemIO: found by the engine because these two methods exist.
    def read_one(self, peer: Peer, view: memoryview, remote: int, gen: int,
                 deadline: Deadline) -> TransferStatus:
        self.fast += 1
        _copy(OpCode.READ, view, remote)
        return TransferStatus.COMPLETED

    def write_one(self, peer: Peer, view: memoryview, remote: int, gen: int,
                  deadline: Deadline) -> TransferStatus:
        self.fast += 1
        _copy(OpCode.WRITE, view, remote)
        return TransferStatus.COMPLETED


def _copy(op: OpCode, local: memoryview, remote: int) -> None:
    """Copy between ``local`` and the same number of bytes at address ``remote``."""
    far = view_at(remote, len(local))
    if op == OpCode.WRITE:
        far[:] = local
    else:
        local[:] = far
