"""Local transport: the target is this engine's own segment, so a request is one memcpy.

Chosen whatever the protocol says: a process never sends bytes to itself through a socket
(Mooncake's TE does the same for a local target). Bounds were checked against the published
descriptor before a slice gets here.
"""

from __future__ import annotations

import os

import numpy as np

from kvplane.common.deadline import Deadline
from kvplane.transfer.batch import Slice
from kvplane.transfer.memory import view_at
from kvplane.transfer.seam import Capabilities, Route, Transport
from kvplane.transfer.types import OpCode, TransferStatus


class LocalTransport(Transport):
    """memcpy between two registered regions of this process."""

    name = "local"
    capabilities = Capabilities(same_host_only=True, priority=4, any_protocol=True)

    def can_reach(self, route: Route) -> bool:
        return (route.same_host and route.segment.pid == os.getpid()  # device memory: no view
                and route.segment.name == self.ctx.segment and route.region.kind not in ("file", "dev"))

    def run(self, route: Route, slices: list[Slice], deadline: Deadline) -> None:
        for s in slices:
            if s.task.req.gen and deadline.expired():  # a store allocation past its window
                s.done(TransferStatus.TIMEOUT, "deadline passed")
                continue
            remote = np.frombuffer(view_at(s.remote, s.length), np.uint8)
            local = np.frombuffer(s.local, np.uint8)
            if s.op == OpCode.WRITE:
                np.copyto(remote, local)
            else:
                np.copyto(local, remote)
            s.done(TransferStatus.COMPLETED)
