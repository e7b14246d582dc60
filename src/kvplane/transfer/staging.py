"""Host staging of device memory for the transfer engine: chunk plans, the staging ring, the
per-device lanes, and the target side's staged READ and WRITE frames.

A device region has no host view; the host transports (TCP, shared memory, CMA) move bytes
between host buffers only. So a request on device memory goes through a *lane*: the device's
copier (:mod:`kvplane.transfer.device`) and a small ring of host staging slots it allocated
(pinned for CUDA) once per engine and device, registered with the engine so the transports
may use them. The request is cut into chunks (:func:`plan_chunks`, ``EngineConfig``'s
``device_chunk``) and each chunk passes through one slot; with two slots the copy of one chunk
overlaps the network move of the next (the initiator's pipelines are
``kvplane.transfer.staged``; the target's are :meth:`DeviceLanes.serve_read` and
:meth:`DeviceLanes.serve_write`, used by the data listener).

A slot goes back to the ring on every path. A slot whose copy had not finished when its
transfer gave up (a stalled device) is held back (``StagingRing.lost``) until that copy's
fence reports done, so a late copy can never write into a slot another transfer holds.

Imports ``transfer.device``, ``transfer.memory`` and ``transfer.types``; never a transport,
the engine, torch or integrations.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Sequence
from typing import NamedTuple

from kvplane.common.deadline import Deadline
from kvplane.common.errors import InvalidArgument, KVPlaneError, Timeout
from kvplane.transfer.device import (
    Copy,
    DeviceCopier,
    Fence,
    HostBuffer,
    MemRegion,
    TracksRegions,
    copier_for,
)
from kvplane.transfer.memory import Region, view_at
from kvplane.transfer.types import RegionDesc

DEFAULT_CHUNK = 4 << 20
DEFAULT_SLOTS = 4
DEPTH = 2  # slots one transfer holds at most: one copying while the other moves


class Chunk(NamedTuple):
    """One piece of a staged request: ``length`` bytes at ``offset`` from its start."""

    offset: int
    length: int


def plan_chunks(length: int, chunk: int) -> list[Chunk]:
    """Cut ``length`` bytes into chunks of ``chunk`` bytes (the last one shorter). Pure.

    Raises:
        InvalidArgument: ``length`` < 1 or ``chunk`` < 1.
    """
    if length < 1 or chunk < 1:
        raise InvalidArgument(f"cannot plan {length} B in chunks of {chunk} B")
    return [Chunk(off, min(chunk, length - off)) for off in range(0, length, chunk)]


class Slot(NamedTuple):
    """One staging slot: its host address and a writable view of its bytes."""

    addr: int
    view: memoryview


class StagingRing:
    """``count`` slots of ``size`` bytes over one host buffer; thread-safe.

    Args:
        buffer: the host staging the device's copier allocated.
        size: bytes per slot.
        count: slots.
    """

    def __init__(self, buffer: HostBuffer, size: int, count: int) -> None:
        if count < 1 or size < 1 or buffer.length < size * count:
            raise InvalidArgument(f"staging ring of {count} x {size} B over {buffer.length} B")
        self.buffer, self.size, self.count = buffer, size, count
        whole = view_at(buffer.addr, size * count)
        self._free = [Slot(buffer.addr + i * size, whole[i * size:(i + 1) * size])
                      for i in range(count)]
        self._held_back: list[tuple[Slot, Fence]] = []
        self._cond = threading.Condition()

    @property
    def free(self) -> int:
        """Slots free now (held-back ones whose copy finished count as free)."""
        with self._cond:
            self._reclaim()
            return len(self._free)

    @property
    def lost(self) -> int:
        """Slots held back because their copy had not finished when their transfer ended."""
        with self._cond:
            self._reclaim()
            return len(self._held_back)

    def take(self, most: int, deadline: Deadline) -> list[Slot]:
        """At least one slot and up to ``most``: blocks only for the first, so transfers that
        compete for the ring never wait on each other's second slot.

        Raises:
            Timeout: no slot came free before ``deadline``.
        """
        with self._cond:
            while True:
                self._reclaim()
                if self._free:
                    n = min(most, len(self._free))
                    got, self._free = self._free[:n], self._free[n:]
                    return got
                left = deadline.remaining()
                if left <= 0:
                    raise Timeout("no device staging slot came free before the deadline")
                self._cond.wait(min(left, 0.05))  # a held-back slot frees without a notify

    def give(self, slots: Sequence[Slot]) -> None:
        """Return slots ``take`` handed out."""
        if slots:
            with self._cond:
                self._free.extend(slots)
                self._cond.notify_all()

    def hold_back(self, slot: Slot, fence: Fence) -> None:
        """Return ``slot`` only once ``fence`` (its unfinished copy) reports done or failed."""
        with self._cond:
            self._held_back.append((slot, fence))

    def _reclaim(self) -> None:
        keep = []
        for slot, fence in self._held_back:
            try:
                fence.wait(0.0)
            except Timeout:
                keep.append((slot, fence))
                continue
            except KVPlaneError:
                pass  # failed: the device is done with the slot
            self._free.append(slot)
        self._held_back = keep


class Lane:
    """The staging path of one device: its copier, its ring, the chunk size.

    Attributes:
        device: the device ("cuda:0", "standin:0").
        copier: the device's copier.
        ring: its staging slots (one chunk each).
        chunk: bytes per chunk.
    """

    def __init__(self, copier: DeviceCopier, ring: StagingRing, chunk: int) -> None:
        self.device, self.copier, self.ring, self.chunk = copier.device, copier, ring, chunk

    def to_host(self, dev_addr: int, slot: Slot, n: int) -> Fence:
        """Start copying ``n`` device bytes at ``dev_addr`` into ``slot`` (KVPlaneError)."""
        return self.copier.copy([Copy(dev_addr, slot.addr, n)], to_device=False)

    def to_device(self, slot: Slot, dev_addr: int, n: int) -> Fence:
        """Start copying ``n`` bytes of ``slot`` to the device at ``dev_addr`` (KVPlaneError)."""
        return self.copier.copy([Copy(slot.addr, dev_addr, n)], to_device=True)

    def wait(self, fence: Fence, deadline: Deadline, what: str) -> None:
        """Wait for ``fence`` until ``deadline``.

        Raises:
            Timeout: the copy did not finish in time (the device stalled).
            KVPlaneError: the copy failed.
        """
        try:
            fence.wait(deadline.remaining())
        except Timeout as exc:
            raise Timeout(f"device copy on {self.device} ({what}) did not finish before the "
                          f"deadline: {exc}") from exc

    def settle(self, pending: Sequence[tuple[Slot, Fence]], deadline: Deadline) -> None:
        """Give back the slots of copies still in flight once each finished (failed copies
        too); one not finished by ``deadline`` is held back (:meth:`StagingRing.hold_back`)."""
        for slot, fence in pending:
            try:
                fence.wait(deadline.remaining())
            except Timeout:
                self.ring.hold_back(slot, fence)
                continue
            except KVPlaneError:
                pass
            self.ring.give([slot])


Register = Callable[[HostBuffer], Region]  # registers staging with the engine (not published)
Unregister = Callable[[Region], object]


class DeviceLanes:
    """The lanes of one engine, per device: copiers built as device regions register, rings
    allocated on a device's first staged move and kept until the engine closes.

    Args:
        register: adds a staging buffer to the engine's memory (so transports may use it).
        unregister: removes it again (at close).
        chunk: bytes per chunk (``EngineConfig.device_chunk``).
        slots: staging slots per device (``EngineConfig.device_slots``).
    """

    def __init__(self, register: Register, unregister: Unregister, chunk: int = DEFAULT_CHUNK,
                 slots: int = DEFAULT_SLOTS) -> None:
        if chunk < 1 or slots < 1:
            raise InvalidArgument(f"device staging needs chunk >= 1 and slots >= 1, got "
                                  f"{chunk} and {slots}")
        self._register, self._unregister = register, unregister
        self.chunk, self.slots = chunk, slots
        self._copiers: dict[str, DeviceCopier] = {}
        self._why: dict[str, str] = {}  # device -> why it has no copier
        self._lanes: dict[str, tuple[Lane, Region]] = {}
        self._lock = threading.Lock()

    def add_region(self, region: Region) -> None:
        """A device region was registered: build its device's copier, or tell it of the
        region. A device kvplane cannot copy keeps the reason; a staged move on it fails with
        it (a region a transport reads directly, such as NIXL VRAM, needs no copier)."""
        mem = MemRegion(region.addr, region.length, region.device, region.keep)
        with self._lock:
            copier = self._copiers.get(region.device)
            if copier is None:
                try:
                    self._copiers[region.device] = copier_for([mem])
                    self._why.pop(region.device, None)
                except InvalidArgument as exc:
                    self._why[region.device] = str(exc)
                return
        if isinstance(copier, TracksRegions):
            copier.add_region(mem)

    def remove_region(self, region: Region) -> None:
        """A device region left the engine (never raises)."""
        copier = self._copiers.get(region.device)
        if isinstance(copier, TracksRegions):
            copier.remove_region(region.addr)

    def lane(self, device: str) -> Lane:
        """The lane of ``device``, its ring allocated and registered on first use.

        Raises:
            InvalidArgument: kvplane has no copier for ``device``.
        """
        with self._lock:
            got = self._lanes.get(device)
            if got is not None:
                return got[0]
            copier = self._copiers.get(device)
            if copier is None:
                raise InvalidArgument(self._why.get(device) or f"no device region on {device} "
                                      "is registered")
            buf = copier.host_buffer(self.chunk * self.slots)
            region = self._register(buf)
            lane = Lane(copier, StagingRing(buf, self.chunk, self.slots), self.chunk)
            self._lanes[device] = (lane, region)
            return lane

    def staging(self) -> list[Region]:
        """The registered staging regions (one per device that staged a move)."""
        with self._lock:
            return [r for _, r in self._lanes.values()]

    def public(self, descs: list[RegionDesc]) -> list[RegionDesc]:
        """``descs`` without the staging regions (this engine's scratch, not for peers)."""
        staging = {r.addr for r in self.staging()}
        return [d for d in descs if d.addr not in staging]

    def close(self) -> None:
        """Unregister every ring's staging (idempotent)."""
        with self._lock:
            lanes, self._lanes = list(self._lanes.values()), {}
        for _, region in lanes:
            try:
                self._unregister(region)
            except KVPlaneError:
                pass

    # -- the target side: frames of the data listener on a device region -------------------------
    def serve_read(self, region: Region, addr: int, n: int, deadline: Deadline
                   ) -> Generator[memoryview, None, None]:
        """The bytes of a READ of ``[addr, addr+n)`` in device ``region``, chunk by chunk: each
        view is copied to the host before it is yielded, and the next chunk's copy runs while
        the caller sends it. The first chunk is ready before the first yield, so a failure
        there raises before the caller answered; a later one raises mid-stream (the caller
        must then drop the connection). Close the iterator (``contextlib.closing``) to get the
        slots back on every path.

        Raises:
            InvalidArgument: no copier for the device; Timeout: a stalled copy;
            KVPlaneError: a failed copy.
        """
        lane = self.lane(region.device)
        plan = plan_chunks(n, lane.chunk)
        free = lane.ring.take(DEPTH, deadline)
        inflight: list[tuple[Slot, Fence, int]] = []
        nxt = 0
        try:
            for c in plan:
                while nxt < len(plan) and free:
                    slot = free.pop()
                    inflight.append((slot, lane.to_host(addr + plan[nxt].offset, slot,
                                                        plan[nxt].length), nxt))
                    nxt += 1
                slot, fence, k = inflight.pop(0)
                try:
                    lane.wait(fence, deadline, f"chunk {k + 1} of {len(plan)} to the host")
                finally:
                    free.append(slot)
                yield slot.view[:c.length]
        finally:
            lane.settle([(s, f) for s, f, _ in inflight], deadline)
            lane.ring.give(free)

    def serve_write(self, region: Region, addr: int, n: int, deadline: Deadline,
                    recv: Callable[[memoryview], None]) -> KVPlaneError | None:
        """Receive a WRITE's ``n`` bytes for device ``region`` at ``addr`` chunk by chunk with
        ``recv`` (fills a view exactly) and copy each to the device while the next arrives.
        Returns once every copy finished: None, or the error of the first that failed (the
        rest of the payload is still received, so the stream stays in sync). ``recv``'s own
        errors (the connection) propagate.
        """
        try:
            lane = self.lane(region.device)
            free = lane.ring.take(DEPTH, deadline)
        except KVPlaneError as exc:
            _drain(recv, n)
            return exc
        plan = plan_chunks(n, lane.chunk)
        inflight: list[tuple[Slot, Fence]] = []
        error: KVPlaneError | None = None
        try:
            for k, c in enumerate(plan):
                if not free:
                    slot, fence = inflight.pop(0)
                    error = error or _waited(lane, fence, deadline, k, len(plan))
                    free.append(slot)
                slot = free.pop()
                recv(slot.view[:c.length])
                if error is None:
                    try:
                        inflight.append((slot, lane.to_device(slot, addr + c.offset, c.length)))
                        continue
                    except KVPlaneError as exc:
                        error = exc
                free.append(slot)
            for k, (_, fence) in enumerate(inflight, len(plan) - len(inflight)):
                error = error or _waited(lane, fence, deadline, k, len(plan))
        finally:
            lane.settle(inflight, deadline)
            lane.ring.give(free)
        return error


def _waited(lane: Lane, fence: Fence, deadline: Deadline, k: int, of: int
            ) -> KVPlaneError | None:
    """The error of waiting for ``fence`` (None: it finished)."""
    try:
        lane.wait(fence, deadline, f"chunk {k + 1} of {of} to the device")
        return None
    except KVPlaneError as exc:
        return exc


def _drain(recv: Callable[[memoryview], None], n: int) -> None:
    scratch = memoryview(bytearray(min(n, 64 << 10) or 1))
    left = n
    while left > 0:
        k = min(left, len(scratch))
        recv(scratch[:k])
        left -= k
