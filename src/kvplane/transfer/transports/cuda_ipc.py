"""CUDA IPC transport: same-host copies into and out of a peer process's CUDA memory, through
the CUDA IPC handles torch exports for a storage (``UntypedStorage._share_cuda_``).

Opt-in (registered as ``cudaipc``, not among the default transports): add it to
``EngineConfig.transports`` on both sides. The owner exports a handle for every ``cuda:N``
region it registers that is a torch tensor and publishes them as this transport's advert; a
same-host peer opens a region's handle once (``UntypedStorage._new_shared_cuda``, cached per
segment and region) and copies with ``Tensor.copy_`` on a side stream, waiting for the copy's
event up to the deadline. Local memory may be a ``cuda:N`` region (a DeviceSlice:
``Capabilities.device_kinds``) or host memory. A failed open or copy is FAILED, a copy past
its deadline TIMEOUT; under protocol "auto" the slice then goes to TCP (the owner's listener
stages it). Like NIXL it bypasses the listener: an engine whose listener serves tenants
(``grants``) exports nothing.

**Never run**: written without a GPU; its only test is tests/gpu/test_engine_cuda.py. Imports
torch when an engine loads it (never at module import).
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from typing import Any

import msgspec

from kvplane.common.deadline import Deadline
from kvplane.common.errors import InvalidArgument, MissingExtra
from kvplane.transfer.batch import Slice
from kvplane.transfer.memory import Region
from kvplane.transfer.seam import Capabilities, Route, Transport, TransportContext
from kvplane.transfer.types import OpCode, RegionKind, TransferStatus

log = logging.getLogger(__name__)


class Export(msgspec.Struct, array_like=True, frozen=True):
    """One region's IPC handle, as ``_share_cuda_`` gives it, plus where the region starts in
    its storage (``inner``) and its length."""

    device: int
    handle: bytes
    size: int
    offset: int
    ref_handle: bytes
    ref_offset: int
    event_handle: bytes
    event_sync: bool
    inner: int
    length: int


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(dict[int, Export])


def decode_advert(blob: bytes) -> dict[int, Export]:
    """Region address -> its export, from a peer's advert (InvalidArgument: malformed)."""
    try:
        return _DEC.decode(blob)
    except msgspec.DecodeError as exc:
        raise InvalidArgument(f"bad CUDA IPC advert: {exc}") from exc


def export_of(tensor: Any) -> Export:
    """The IPC export of a contiguous CUDA tensor's region."""
    storage = tensor.untyped_storage()
    dev, handle, size, offset, ref_h, ref_off, ev_h, ev_sync = storage._share_cuda_()
    return Export(int(dev), bytes(handle), int(size), int(offset), bytes(ref_h or b""),
                  int(ref_off or 0), bytes(ev_h or b""), bool(ev_sync),
                  int(tensor.data_ptr()) - int(storage.data_ptr()),
                  int(tensor.numel() * tensor.element_size()))


class CudaIpcTransport(Transport):
    """Same-host CUDA IPC copies (see the module docstring)."""

    name = "cudaipc"
    capabilities = Capabilities(same_host_only=True, priority=3, fallbacks=("tcp",),
                                device_kinds=("cuda",))

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        try:
            import torch
        except ImportError as exc:
            raise MissingExtra("the cudaipc transport needs torch with CUDA") from exc
        if not torch.cuda.is_available():
            raise InvalidArgument("the cudaipc transport needs a CUDA device")
        self._torch: Any = torch  # untyped in places (Stream, Event, _new_shared_cuda)
        self._lock = threading.Lock()
        self._exports: dict[int, Export] = {}
        self._starts: list[int] = []  # local cuda regions, sorted
        self._flat: dict[int, Any] = {}  # start -> flat uint8 tensor of the region
        self._opened: dict[tuple[str, int, bytes], Any] = {}  # (segment, addr, handle) -> flat
        self._streams: dict[int, Any] = {}

    # -- registration and advert ----------------------------------------------------------------
    def on_register(self, region: Region) -> None:
        t = region.keep
        if (self.ctx.grants or not region.device.startswith("cuda")
                or not type(t).__module__.startswith("torch")):
            return
        exp = export_of(t)
        with self._lock:
            self._exports[region.addr] = exp
            bisect.insort(self._starts, region.addr)
            self._flat[region.addr] = t.reshape(-1).view(self._torch.uint8)

    def on_unregister(self, region: Region) -> None:
        with self._lock:
            if self._exports.pop(region.addr, None) is not None:
                self._starts.remove(region.addr)
                self._flat.pop(region.addr, None)

    def advert(self) -> bytes:
        with self._lock:
            return _ENC.encode(self._exports) if self._exports else b""

    # -- routes -----------------------------------------------------------------------------------
    def can_reach(self, route: Route) -> bool:
        region = route.region
        if not (route.same_host and region.kind == RegionKind.DEVICE
                and region.device.startswith("cuda") and route.segment.pid != os.getpid()):
            return False
        blob = route.segment.adverts.get(self.name)
        if not blob:
            return False
        try:
            return region.addr in decode_advert(blob)
        except InvalidArgument:
            return False

    def _remote(self, route: Route) -> Any:
        """The flat uint8 tensor of the peer's region (opened once per handle)."""
        exp = decode_advert(route.segment.adverts[self.name])[route.region.addr]
        key = (route.segment.name, route.region.addr, exp.handle)
        with self._lock:
            got = self._opened.get(key)
        if got is not None:
            return got
        torch = self._torch
        storage = torch.UntypedStorage._new_shared_cuda(
            exp.device, exp.handle, exp.size, exp.offset, exp.ref_handle, exp.ref_offset,
            exp.event_handle, exp.event_sync)
        flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{exp.device}").set_(storage)
        flat = flat[exp.inner:exp.inner + exp.length]
        with self._lock:
            return self._opened.setdefault(key, flat)

    def _local(self, s: Slice) -> Any:
        """The local side of ``s`` as a uint8 tensor: its CUDA region's, or its host view's."""
        if not s.device:
            return self._torch.frombuffer(s.local, dtype=self._torch.uint8)
        with self._lock:
            i = bisect.bisect_right(self._starts, s.addr) - 1
            flat = self._flat.get(self._starts[i]) if i >= 0 else None
            start = self._starts[i] if i >= 0 else 0
        if flat is None or s.addr + s.length > start + flat.numel():
            raise InvalidArgument(f"{s.addr:#x}+{s.length} is in no local CUDA region")
        return flat[s.addr - start:s.addr - start + s.length]

    # -- the data path ----------------------------------------------------------------------------
    def run(self, route: Route, slices: list[Slice], deadline: Deadline) -> None:
        try:
            remote = self._remote(route)
        except Exception as exc:  # torch raises RuntimeError for a handle it cannot open
            for s in slices:
                s.done(TransferStatus.FAILED, f"CUDA IPC could not open the peer's memory: {exc}")
            return
        for s in slices:
            if deadline.expired():
                s.done(TransferStatus.TIMEOUT, "deadline passed")
                continue
            off = s.remote - route.region.addr
            try:
                self._copy(s, remote[off:off + s.length], deadline)
            except TimeoutError:
                s.done(TransferStatus.TIMEOUT, "CUDA IPC copy not done before the deadline")
                continue
            except (RuntimeError, InvalidArgument) as exc:
                s.done(TransferStatus.FAILED, f"CUDA IPC copy failed: {exc}")
                continue
            s.done(TransferStatus.COMPLETED)

    def _copy(self, s: Slice, remote: Any, deadline: Deadline) -> None:
        """One copy on the remote device's side stream, waited for up to ``deadline``."""
        torch = self._torch
        local = self._local(s)
        dst, src = (remote, local) if s.op == OpCode.WRITE else (local, remote)
        dev = remote.device
        stream = self._streams.get(dev.index)
        if stream is None:
            stream = self._streams.setdefault(dev.index, torch.cuda.Stream(device=dev))
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        pause = 2e-5
        while not event.query():
            if deadline.expired():
                raise TimeoutError
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def close(self) -> None:
        """Drop the opened peer mappings (idempotent)."""
        with self._lock:
            self._opened.clear()
