"""A transport that moves stand-in device memory by itself, as NIXL/UCX moves CUDA memory
(GPUDirect): for CPU tests of the engine's device-capable route (``Capabilities.device_kinds``:
DeviceSlices handed over unstaged, the fallback staged).

Reaches host memory of engines in this process only (it copies with ``view_at``); the device
side goes through the stand-in's test access, standing in for the fabric's own DMA. Load it as
``"tests.support.standin_fabric:StandinFabric"`` in ``EngineConfig.transports``. ``fail``
makes every slice FAILED (then the engine's fallback runs). Test kit, not product.
"""

from __future__ import annotations

import os

from kvplane.common.deadline import Deadline
from kvplane.transfer.batch import Slice
from kvplane.transfer.memory import view_at
from kvplane.transfer.seam import Capabilities, Route, Transport
from kvplane.transfer.types import OpCode, TransferStatus
from tests.support.standin_device import DEVICES

NAME = "tests.support.standin_fabric:StandinFabric"


class StandinFabric(Transport):
    """See the module docstring; ``seen`` records (device, addr) per slice ("" and 0: host
    memory, moved through ``local``)."""

    name = "standin-fabric"
    capabilities = Capabilities(priority=5, fallbacks=("tcp",), device_kinds=("standin",))

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.seen: list[tuple[str, int]] = []
        self.fail = False

    def can_reach(self, route: Route) -> bool:
        return route.segment.pid == os.getpid() and route.region.kind in ("mem", "shm")

    def run(self, route: Route, slices: list[Slice], deadline: Deadline) -> None:
        for s in slices:
            self.seen.append((s.device, s.addr))
            if self.fail:
                s.done(TransferStatus.FAILED, "stand-in fabric: told to fail")
                continue
            remote = view_at(s.remote, s.length)
            if s.device:
                dev = DEVICES[s.device]
                if s.op == OpCode.WRITE:
                    remote[:] = dev.read(s.addr, s.length)
                else:
                    dev.write(s.addr, bytes(remote))
            elif s.op == OpCode.WRITE:
                remote[:] = s.local
            else:
                s.local[:] = remote
            s.done(TransferStatus.COMPLETED)
