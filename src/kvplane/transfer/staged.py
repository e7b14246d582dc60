"""The initiator's staged pipelines: requests whose local memory is a device region, moved by a
host transport through the device's staging lane (``kvplane.transfer.staging``).

:class:`StagedTransport` wraps the transport the engine picked for the route. Each request is
one slice here (its local side is the device range ``task.req.source``; the slice carries no
view) and is cut into chunks; each chunk goes through one staging slot and the wrapped
transport, as a slice of its own whose outcome is captured (``failover.Shadow``) rather than
reported, so the request is reported once, after its last byte reached its destination:

* WRITE (device -> peer): the copy of chunk k+1 to the host is started before chunk k is sent,
  so with an asynchronous device (a CUDA stream) the copy and the send overlap;
* READ (peer -> device): chunk k+1 is received while chunk k copies to the device; the
  request is COMPLETED only once every copy to the device finished.

A failed copy fails the request (FAILED, the device's error), a stalled one ends it at its
deadline (TIMEOUT); in both cases it is never reported COMPLETED, and every staging slot goes
back to the ring (or is held back until its copy ends). The wrapped transport's fallback
(``Capabilities.fallbacks``) applies per chunk, inside; the wrapper declares none itself.

Imports the seam, failover and staging; never a transport module nor the engine.
"""

from __future__ import annotations

from kvplane.common.deadline import Deadline
from kvplane.common.errors import KVPlaneError, Timeout
from kvplane.transfer.batch import Slice
from kvplane.transfer.device import Fence
from kvplane.transfer.failover import Shadow, guarded
from kvplane.transfer.seam import Capabilities, Route, Transport
from kvplane.transfer.staging import DEPTH, DeviceLanes, Lane, Slot, plan_chunks
from kvplane.transfer.types import OpCode, TransferStatus

NO_VIEW = memoryview(b"")  # the local side of a device slice: its bytes have no host view

Outcome = tuple[TransferStatus, str]
_OK: Outcome = (TransferStatus.COMPLETED, "")


class _Failed(Exception):
    """Ends one staged request with ``outcome``."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome[1])
        self.outcome = outcome


def _copy_error(exc: KVPlaneError) -> _Failed:
    status = TransferStatus.TIMEOUT if isinstance(exc, Timeout) else TransferStatus.FAILED
    return _Failed((status, f"device copy failed: {exc}"))


class StagedTransport(Transport):
    """Runs device-local slices through ``inner`` via host staging.

    Args:
        inner: the host transport the engine picked for the route.
        fallback: where ``inner``'s failed chunks go (None: nowhere).
        lanes: the engine's device lanes.
        device: the local device of the slices this wrapper runs.
    """

    capabilities = Capabilities()

    def __init__(self, inner: Transport, fallback: Transport | None, lanes: DeviceLanes,
                 device: str) -> None:
        super().__init__(inner.ctx)
        self.name = inner.name  # metrics and logs name the transport that moves the bytes
        self.inner, self.fallback, self.lanes, self.device = inner, fallback, lanes, device

    def can_reach(self, route: Route) -> bool:
        return self.inner.can_reach(route)

    def run(self, route: Route, slices: list[Slice], deadline: Deadline) -> None:
        """Run each device slice's pipeline in turn; each slice reports once, at its end."""
        for s in slices:
            try:
                lane = self.lanes.lane(self.device)
                go = self._write if s.op == OpCode.WRITE else self._read
                go(lane, route, s, deadline)
                outcome = _OK
            except _Failed as failed:
                outcome = failed.outcome
            except KVPlaneError as exc:  # no lane: a device kvplane cannot copy
                outcome = (TransferStatus.FAILED, str(exc))
            s.done(*outcome)

    def _move(self, route: Route, s: Slice, view: memoryview, offset: int,
              deadline: Deadline) -> None:
        """One chunk through the wrapped transport (raises _Failed with its outcome)."""
        piece = Shadow(Slice(s.task, s.op, view, s.remote + offset, len(view)))
        guarded(self.inner, route, [piece], deadline, self.fallback)  # type: ignore[list-item]  # a Shadow stands in for its Slice
        if piece.status != TransferStatus.COMPLETED:
            raise _Failed((piece.status or TransferStatus.FAILED, piece.error))

    def _take(self, lane: Lane, deadline: Deadline) -> list[Slot]:
        try:
            return lane.ring.take(DEPTH, deadline)
        except Timeout as exc:
            raise _Failed((TransferStatus.TIMEOUT, str(exc))) from exc

    def _write(self, lane: Lane, route: Route, s: Slice, deadline: Deadline) -> None:
        """Device -> host -> peer, the next chunk's copy started before this one is sent."""
        plan = plan_chunks(s.length, lane.chunk)
        dev = s.task.req.source
        free = self._take(lane, deadline)
        inflight: list[tuple[Slot, Fence, int]] = []
        nxt = 0
        try:
            for k, c in enumerate(plan):
                while nxt < len(plan) and free:  # copy ahead into every free slot
                    slot = free.pop()
                    try:
                        fence = lane.to_host(dev + plan[nxt].offset, slot, plan[nxt].length)
                    except KVPlaneError as exc:
                        free.append(slot)
                        raise _copy_error(exc) from exc
                    inflight.append((slot, fence, nxt))
                    nxt += 1
                slot, fence, _ = inflight.pop(0)
                try:
                    lane.wait(fence, deadline, f"chunk {k + 1} of {len(plan)} to the host")
                except KVPlaneError as exc:
                    lane.settle([(slot, fence)], deadline)
                    raise _copy_error(exc) from exc
                try:
                    self._move(route, s, slot.view[:c.length], c.offset, deadline)
                finally:
                    free.append(slot)
        finally:
            lane.settle([(sl, f) for sl, f, _ in inflight], deadline)
            lane.ring.give(free)

    def _read(self, lane: Lane, route: Route, s: Slice, deadline: Deadline) -> None:
        """Peer -> host -> device, the next chunk received while this one copies."""
        plan = plan_chunks(s.length, lane.chunk)
        dev = s.task.req.source
        free = self._take(lane, deadline)
        inflight: list[tuple[Slot, Fence, int]] = []
        try:
            for k, c in enumerate(plan):
                if not free:  # reuse the slot of the oldest copy once it finished
                    self._landed(lane, inflight.pop(0), free, deadline, len(plan))
                slot = free.pop()
                try:
                    self._move(route, s, slot.view[:c.length], c.offset, deadline)
                    fence = lane.to_device(slot, dev + c.offset, c.length)
                except KVPlaneError as exc:
                    free.append(slot)
                    raise _copy_error(exc) from exc
                except BaseException:
                    free.append(slot)
                    raise
                inflight.append((slot, fence, k))
            while inflight:
                self._landed(lane, inflight.pop(0), free, deadline, len(plan))
        finally:
            lane.settle([(sl, f) for sl, f, _ in inflight], deadline)
            lane.ring.give(free)

    @staticmethod
    def _landed(lane: Lane, entry: tuple[Slot, Fence, int], free: list[Slot],
                deadline: Deadline, of: int) -> None:
        """Wait for one chunk's copy to the device; its slot goes back to ``free`` (or is
        held back when the copy stalled)."""
        slot, fence, k = entry
        try:
            lane.wait(fence, deadline, f"chunk {k + 1} of {of} to the device")
        except KVPlaneError as exc:
            lane.settle([(slot, fence)], deadline)
            raise _copy_error(exc) from exc
        free.append(slot)

    def close(self) -> None:
        """Nothing of its own: the wrapped transport is the engine's."""

