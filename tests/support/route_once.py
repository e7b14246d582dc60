"""A transport for tests of ``TransferEngine.transfer_one``: copies within this process (as the
loopback example does) and has the ``RouteOneIO`` capability, counting what reached it."""

from __future__ import annotations

import os
import time

from kvplane.common.deadline import Deadline
from kvplane.transfer.batch import Slice
from kvplane.transfer.memory import view_at
from kvplane.transfer.seam import Capabilities, Outcome, Route, Transport, TransportContext
from kvplane.transfer.types import OpCode, RegionKind, TransferStatus

PATH = "tests.support.route_once:RouteOnce"


class RouteOnce(Transport):
    """memcpy to the regions of engines in this process; ``calls`` lists the requests its
    ``route_one`` ran as ``(op, local, remote, length)`` and ``routes`` how many regions the
    descriptor of each one's route had; ``slices`` counts what ``run`` got."""

    name = "routeonce"
    capabilities = Capabilities(priority=0)

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self.calls: list[tuple[OpCode, int, int, int]] = []
        self.routes: list[int] = []
        self.slices = 0

    def can_reach(self, route: Route) -> bool:
        return (route.segment.pid == os.getpid()
                and route.region.kind not in (RegionKind.FILE, RegionKind.DEVICE))

    def run(self, route: Route, slices: list[Slice], deadline: Deadline) -> None:
        for s in slices:
            self.slices += 1
            _copy(s.op, s.local, s.remote)
            s.done(TransferStatus.COMPLETED)

    def route_one(self, op: OpCode, route: Route, local: int, remote: int, length: int,
                  at: float) -> Outcome | None:
        if time.monotonic() >= at:
            return TransferStatus.TIMEOUT, "deadline passed"
        self.calls.append((op, local, remote, length))
        self.routes.append(len(route.segment.regions))
        _copy(op, view_at(local, length), remote)
        return TransferStatus.COMPLETED, ""


def _copy(op: OpCode, local: memoryview, remote: int) -> None:
    far = view_at(remote, len(local))
    if op == OpCode.WRITE:
        far[:] = local
    else:
        local[:] = far
