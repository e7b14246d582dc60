"""An in-process transport for the TransferEngine registry (``"mem"``), with scripted faults.

Engines of one process that load the ``mem`` transport and are attached to one
:class:`MemFabric` move bytes between each other's registered memory with one copy, as if over
a network: the target is found by segment name; a target that closed or restarted (its port
changed) fails the slice like a refused connection; and the target's own memory table checks
every range, as its data server would. No sockets or threads of its own (the engines still
bind their listeners).

    fabric = MemFabric(FaultPlan(seed=1).fail(peer="seg-a", op="read"))  # registers "mem"
    a = TransferEngine(name="seg-a", transports=("tcp", "local", "mem"), protocol="mem",
                       metadata="memory://test")
    fabric.attach(a)

Faults come from ``fabric.plan``, keyed by the target segment's name and ``"read"``/``"write"``:

* DROP       the slice is lost: it finishes TIMEOUT when the deadline passes (waited out).
* DELAY      it completes ``seconds`` late (TIMEOUT if that is past the deadline).
* FAIL       FAILED with an "injected failure" message; no bytes move.
* CORRUPT    the bytes move, then one byte of the destination is flipped (silent corruption).
* DISCONNECT FAILED like a broken connection (this transport does not retry; TCP's retry is
             tested against fake sockets in tests/unit/transfer/test_tcp_conn.py).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvplane.common.deadline import Deadline
from kvplane.common.errors import InvalidArgument, KVPlaneError
from kvplane.testing.faults import Fault, FaultKind, FaultPlan
from kvplane.transfer import TransferEngine
from kvplane.transfer.batch import Slice
from kvplane.transfer.memory import MemoryTable
from kvplane.transfer.seam import Capabilities, Route, Transport, TransportContext
from kvplane.transfer.transports import TRANSPORTS
from kvplane.transfer.types import OpCode, SegmentDesc, TransferStatus

NAME = "mem"


def register() -> None:
    """Register ``mem`` with the transport registry (idempotent)."""
    if NAME not in TRANSPORTS.names():
        TRANSPORTS.register(NAME, f"{__name__}:MemTransport")


@dataclass(frozen=True)
class _Target:
    """An attached engine as its peers reach it."""

    port: int
    memory: MemoryTable
    transport: MemTransport


class MemFabric:
    """The engines that can reach each other through ``mem``, and the faults between them.

    Args:
        plan: faults to inject (default: none).
        sleep: how drops and delays are waited out.
    """

    def __init__(self, plan: FaultPlan | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        register()
        self.plan = plan or FaultPlan()
        self.sleep = sleep
        self._targets: dict[str, _Target] = {}
        self._lock = threading.Lock()
        self.moves: Counter[tuple[str, str]] = Counter()  # (segment, op) -> slices completed

    def attach(self, engine: TransferEngine) -> TransferEngine:
        """Make ``engine`` reachable under its segment name, and let it reach the others.

        Raises:
            InvalidArgument: the engine did not load the ``mem`` transport.
        """
        transport = engine.transports.get(NAME)
        if not isinstance(transport, MemTransport):
            raise InvalidArgument(f"engine {engine.name!r} did not load the {NAME!r} transport")
        transport.fabric = self
        with self._lock:
            self._targets[engine.name] = _Target(engine.port, engine.memory, transport)
        return engine

    def forget(self, transport: MemTransport) -> None:
        """Detach whatever engine ``transport`` belongs to (its engine is closing)."""
        with self._lock:
            for name in [n for n, t in self._targets.items() if t.transport is transport]:
                del self._targets[name]

    def count_move(self, segment: str, op: str) -> None:
        with self._lock:
            self.moves[(segment, op)] += 1

    def target(self, segment: SegmentDesc) -> _Target | None:
        """The live engine behind ``segment``: None when it closed or restarted since."""
        with self._lock:
            found = self._targets.get(segment.name)
        return found if found is not None and found.port == segment.port else None


class MemTransport(Transport):
    """Copies between engines attached to the same :class:`MemFabric`. Thread-safe."""

    name = NAME
    capabilities = Capabilities(same_host_only=True, priority=0)

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self.fabric: MemFabric | None = None

    def can_reach(self, route: Route) -> bool:
        return self.fabric is not None and route.segment.pid == os.getpid()

    def run(self, route: Route, slices: list[Slice], deadline: Deadline) -> None:
        fabric = self.fabric
        target = fabric.target(route.segment) if fabric is not None else None
        for s in slices:
            if fabric is None or target is None:
                s.done(TransferStatus.FAILED,
                       f"segment {route.segment.name!r} is gone: connection refused")
                continue
            op = "write" if s.op == OpCode.WRITE else "read"
            fault = fabric.plan.decide(route.segment.name, op)
            if self._move(fabric, s, target, fault, deadline):
                fabric.count_move(route.segment.name, op)

    def _move(self, fabric: MemFabric, s: Slice, target: _Target, fault: Fault | None,
              deadline: Deadline) -> bool:
        """Finish ``s`` as the fault says; True when its bytes moved."""
        if fault is not None and fault.kind in (FaultKind.FAIL, FaultKind.DISCONNECT):
            what = "connection reset" if fault.kind is FaultKind.DISCONNECT else "injected failure"
            s.done(TransferStatus.FAILED, f"{what} ({fault.op} at {fault.peer})")
            return False
        if fault is not None and not self._wait_out(fabric, fault, deadline):
            s.done(TransferStatus.TIMEOUT, "deadline passed waiting for the peer")
            return False
        try:
            remote = np.frombuffer(target.memory.view(s.remote, s.length), np.uint8)
        except KVPlaneError as exc:
            s.done(TransferStatus.FAILED, str(exc))
            return False
        local = np.frombuffer(s.local, np.uint8)
        source, dest = (local, remote) if s.op == OpCode.WRITE else (remote, local)
        np.copyto(dest, source)
        if fault is not None and fault.kind is FaultKind.CORRUPT:
            fault.flip(dest.data)
        s.done(TransferStatus.COMPLETED)
        return True

    @staticmethod
    def _wait_out(fabric: MemFabric, fault: Fault, deadline: Deadline) -> bool:
        """Wait as a DROP or DELAY says; False when the deadline passes first."""
        if fault.kind is FaultKind.DROP or fault.kind is FaultKind.DELAY and \
                fault.seconds >= deadline.remaining():
            fabric.sleep(deadline.remaining())
            return False
        if fault.kind is FaultKind.DELAY:
            fabric.sleep(fault.seconds)
        return True

    def close(self) -> None:
        if self.fabric is not None:
            self.fabric.forget(self)
