"""TorchCopier: the device copier (:mod:`kvplane.transfer.device`) for torch tensors.

Resolves each address of a copy inside a registered device region (a flat view of the KV
allocation) or inside the host staging buffer this copier allocated, and copies the byte
ranges with ``Tensor.copy_``: never a host view of device memory. On CUDA the copies run on a
side stream that first waits for the current stream (so a save reads what the forward wrote),
host staging is pinned, and each batch ends with an event the fence polls up to its deadline.
Other torch devices copy synchronously.

Imports torch at module import; :func:`kvplane.transfer.device.copier_for` loads it only for
torch tensors on a device (the connectors reach it through ``kvplane.integrations.torch_device``,
which re-exports it). Imports nothing else of kvplane but ``common`` and ``transfer.device``.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvplane.common.errors import DeviceFailed, InvalidArgument, Timeout
from kvplane.transfer.device import DONE, Copy, Fence, HostBuffer, MemRegion


class _EventFence:
    """Completion of a CUDA batch: its event, polled (a CUDA error in the copy surfaces here)."""

    def __init__(self, event: Any) -> None:
        self._event = event

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pause = 2e-5
        try:
            while not self._event.query():
                if time.monotonic() >= deadline:
                    raise Timeout(f"device copy not done after {timeout:.1f} s")
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
        except RuntimeError as exc:  # a failed asynchronous copy (CUDA error)
            raise DeviceFailed(f"device copy failed: {exc}") from exc


class _Spans:
    """Sorted (start, length, flat uint8 tensor) spans, looked up by address."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._spans: list[tuple[int, int, Any]] = []

    def add(self, start: int, length: int, flat: Any) -> None:
        i = bisect.bisect(self._starts, start)
        self._starts.insert(i, start)
        self._spans.insert(i, (start, length, flat))

    def remove(self, start: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] == start:
            del self._starts[i]
            del self._spans[i]

    def slice(self, addr: int, n: int, what: str) -> Any:
        i = bisect.bisect(self._starts, addr) - 1
        if i >= 0:
            start, length, flat = self._spans[i]
            if addr + n <= start + length:
                return flat[addr - start:addr - start + n]
        raise InvalidArgument(f"{what} range {addr:#x}+{n} lies outside every registered region")


def _bytes_of(t: Any, length: int) -> Any:
    """A flat uint8 view of ``length`` bytes of ``t``'s memory from its first element."""
    flat = t.reshape(-1) if t.is_contiguous() else None
    if flat is None:
        raise InvalidArgument("a device region must be given as one contiguous tensor")
    raw = flat.view(torch.uint8)
    if raw.numel() < length:
        raise InvalidArgument(f"device region tensor holds {raw.numel()} B, not {length} B")
    return raw[:length]


class TorchCopier:
    """Copies between torch device regions and torch host staging, by address.

    Args:
        regions: the device's registered regions; ``tensor`` spans each from its ``addr``.

    Raises:
        InvalidArgument: a region without a tensor, or not contiguous.
    """

    def __init__(self, regions: Sequence[MemRegion]) -> None:
        self.device = regions[0].device
        self._dev = _Spans()
        self._host = _Spans()
        self._tdev = torch.device(self.device)
        for r in regions:
            self.add_region(r)
        self._cuda = self._tdev.type == "cuda"
        self._stream = torch.cuda.Stream(device=self._tdev) if self._cuda else None  # type: ignore[no-untyped-call]  # torch leaves Stream untyped

    def add_region(self, r: MemRegion) -> None:
        """Resolve device addresses in ``r`` from now on (``TracksRegions``).

        Raises:
            InvalidArgument: ``r`` has no tensor, or its tensor does not start at ``r.addr``.
        """
        if r.tensor is None:
            raise InvalidArgument(f"region on {r.device} has no tensor to copy through")
        if int(r.tensor.data_ptr()) != r.addr:
            raise InvalidArgument(f"region tensor on {r.device} does not start at its region")
        self._dev.add(r.addr, r.length, _bytes_of(r.tensor, r.length))

    def remove_region(self, addr: int) -> None:
        """Forget the region starting at ``addr`` (``TracksRegions``)."""
        self._dev.remove(addr)

    def host_buffer(self, nbytes: int) -> HostBuffer:
        """Host staging (pinned on CUDA, so copies are asynchronous DMA)."""
        t = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=self._cuda)
        self._host.add(int(t.data_ptr()), nbytes, t)
        return HostBuffer(int(t.data_ptr()), nbytes, t)

    def copy(self, moves: Sequence[Copy], to_device: bool) -> Fence:
        src_of, dst_of = (self._host, self._dev) if to_device else (self._dev, self._host)
        pairs = [(dst_of.slice(m.dst, m.length, "destination"),
                  src_of.slice(m.src, m.length, "source")) for m in moves]
        try:
            if self._stream is None:
                for dst, src in pairs:
                    dst.copy_(src)
                return DONE
            self._stream.wait_stream(torch.cuda.current_stream(self._tdev))
            with torch.cuda.stream(self._stream):
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves Event untyped
                event.record(self._stream)
        except RuntimeError as exc:
            raise DeviceFailed(f"device copy on {self.device} failed: {exc}") from exc
        return _EventFence(event)
