"""A stand-in accelerator for CPU tests of the connectors' device paths.

``StandinDevice("standin:0")`` owns memory the host cannot address: its addresses lie in a
non-canonical range (``0x7D00...``), so a host view of them could never work, and the store's
engine knows none of them (any move that is not through the device copier fails with
``AddressNotRegistered``). ``tensor`` gives duck-typed tensors with vLLM's attributes
(``data_ptr``, ``shape``, ``stride``, ``element_size``, ``untyped_storage``, ``device``,
``as_strided``), so :class:`~kvplane.integrations.vllm.layout.KVLayout` reads them as it reads
CUDA tensors. Its copier (registered for the ``standin`` kind with
:func:`~kvplane.integrations.device_kv.register_device_kind`) copies by address between the
device's memory and host staging it allocated, like ``cudaMemcpyAsync``:

* ``lazy=True`` defers each batch until its fence is waited for, so a caller that uses bytes
  before waiting reads stale ones;
* ``fail_to_device`` / ``fail_to_host`` (counts of batches) make copies refuse at enqueue
  (``refuse=True``) or fail at the fence, as an asynchronous device error would; ``skip``
  (per direction) lets that many batches through first (a failure at chunk k);
* ``threaded=True`` runs batches in order on one worker thread, as a CUDA stream does (the
  fence waits for it up to its timeout, then raises ``Timeout``); there ``gates[(kind, i)]``
  holds batch ``i`` of a direction until the event is set, and ``stall`` (an event) holds
  every batch until it is set: a stalled device.

Every batch is logged in ``log`` (``("enqueue"|"run"|"done"|"failed", kind, index)``), so a
test can check the order of copies against other events it appends (``note``).

The test side reads and writes device memory with ``read``/``write`` (test access, not a view).
Test kit, not product.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvplane.common.errors import InvalidArgument, Timeout
from kvplane.integrations.device_kv import (
    DONE,
    Copy,
    Fence,
    HostBuffer,
    MemRegion,
    register_device_kind,
)
from kvplane.store.errors import TransferFail

BASE = 0x7D00_0000_0000_0000
STRIDE = 1 << 40
DEVICES: dict[str, StandinDevice] = {}


class _Device:
    def __init__(self, name: str) -> None:
        self.type, _, index = name.partition(":")
        self.index = int(index or 0)
        self._name = name

    def __str__(self) -> str:
        return self._name


class _Storage:
    def __init__(self, addr: int, nbytes: int) -> None:
        self._addr, self._nbytes = addr, nbytes

    def data_ptr(self) -> int:
        return self._addr

    def nbytes(self) -> int:
        return self._nbytes


class StandinTensor:
    """A strided view of stand-in device memory (what KVLayout and the copier read)."""

    def __init__(self, dev: StandinDevice, alloc: int, offset: int, shape: Sequence[int],
                 strides: Sequence[int], itemsize: int) -> None:
        self.dev, self.alloc, self.offset = dev, alloc, offset
        self.shape = tuple(int(s) for s in shape)
        self._strides = tuple(int(s) for s in strides)
        self._itemsize = itemsize
        self.device = _Device(dev.name)
        self.dtype: Any = None  # what a caller says the elements are (only ever printed)

    def data_ptr(self) -> int:
        return self.alloc + self.offset

    def stride(self, d: int) -> int:
        return self._strides[d]

    def element_size(self) -> int:
        return self._itemsize

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def untyped_storage(self) -> _Storage:
        return _Storage(self.alloc, len(self.dev.memory[self.alloc]))

    def is_contiguous(self) -> bool:
        expected = 1
        for s, st in zip(reversed(self.shape), reversed(self._strides)):
            if s != 1 and st != expected:
                return False
            expected *= s
        return True

    def as_strided(self, size: Sequence[int], stride: Sequence[int],
                   storage_offset: int = 0) -> StandinTensor:
        return StandinTensor(self.dev, self.alloc, storage_offset * self._itemsize, size, stride,
                             self._itemsize)


class _LazyFence:
    def __init__(self, run: Any) -> None:
        self._run, self._lock = run, threading.Lock()

    def wait(self, timeout: float) -> None:
        with self._lock:
            run, self._run = self._run, None
        if run is not None:
            run()


class _FailedFence:
    def wait(self, timeout: float) -> None:
        raise TransferFail("stand-in device: copy failed")


class _JobFence:
    """A batch queued on the worker thread: done when the worker ran it."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.failed = False

    def wait(self, timeout: float) -> None:
        if not self.done.wait(timeout):
            raise Timeout(f"stand-in device: copy not done after {timeout:.2f} s")
        if self.failed:
            raise TransferFail("stand-in device: copy failed")


class StandinDevice:
    """Fake device memory plus the copier the staging code drives.

    Attributes:
        memory: allocation address -> backing bytes (only this class touches them).
        batches: copy batches run, by direction (``to_device`` / ``to_host``).
        log: what happened, in order (see the module docstring).
    """

    def __init__(self, name: str = "standin:0", lazy: bool = False,
                 threaded: bool = False) -> None:
        self.name, self.lazy = name, lazy
        self.memory: dict[int, np.ndarray] = {}
        self.host: dict[int, np.ndarray] = {}
        self.fail_to_device = 0
        self.fail_to_host = 0
        self.skip = {"to_device": 0, "to_host": 0}
        self.refuse = False
        self.batches = {"to_device": 0, "to_host": 0}
        self.log: list[tuple[Any, ...]] = []
        self.gates: dict[tuple[str, int], threading.Event] = {}
        self.stall: threading.Event | None = None
        self._next = BASE + len(DEVICES) * STRIDE * 64
        self._lock = threading.Lock()
        self._jobs: queue.Queue[Callable[[], None] | None] | None = None
        self._worker: threading.Thread | None = None
        if threaded:
            self._jobs = queue.Queue()
            self._worker = threading.Thread(target=self._work, name=f"standin-{name}",
                                            daemon=True)
            self._worker.start()
        DEVICES[name] = self
        register_device_kind(name.split(":")[0], _copier)

    def note(self, *event: Any) -> None:
        """Append ``event`` to the log (tests add their own events between the copies')."""
        with self._lock:
            self.log.append(event)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker thread (threaded devices; releases a stall first)."""
        if self.stall is not None:
            self.stall.set()
        for gate in self.gates.values():
            gate.set()
        if self._jobs is not None and self._worker is not None:
            self._jobs.put(None)
            self._worker.join(timeout)
            self._jobs = None

    def _work(self) -> None:
        jobs = self._jobs
        assert jobs is not None
        while (job := jobs.get()) is not None:
            job()

    # -- memory ------------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        """Device memory of ``nbytes`` zero bytes; returns its (host-unaddressable) address."""
        addr = self._next
        self._next += STRIDE
        self.memory[addr] = np.zeros(nbytes, np.uint8)
        return addr

    def tensor(self, shape: Sequence[int], strides: Sequence[int], itemsize: int,
               alloc: int, offset: int = 0) -> StandinTensor:
        """A view of allocation ``alloc`` from byte ``offset`` (strides in elements)."""
        return StandinTensor(self, alloc, offset, shape, strides, itemsize)

    def _find(self, table: dict[int, np.ndarray], addr: int, n: int) -> np.ndarray | None:
        for start, arr in table.items():
            if start <= addr and addr + n <= start + len(arr):
                return arr[addr - start:addr - start + n]
        return None

    def read(self, addr: int, n: int) -> bytes:
        """Test access to device bytes."""
        arr = self._find(self.memory, addr, n)
        if arr is None:
            raise InvalidArgument(f"{addr:#x}+{n} is not stand-in device memory")
        return arr.tobytes()

    def write(self, addr: int, data: bytes) -> None:
        """Test access: put ``data`` into device memory at ``addr``."""
        arr = self._find(self.memory, addr, len(data))
        if arr is None:
            raise InvalidArgument(f"{addr:#x}+{len(data)} is not stand-in device memory")
        arr[:] = np.frombuffer(data, np.uint8)

    def digest(self, addr: int, n: int) -> str:
        return hashlib.sha256(self.read(addr, n)).hexdigest()

    # -- the copier --------------------------------------------------------------------------------
    def host_buffer(self, nbytes: int) -> HostBuffer:
        arr = np.zeros(nbytes, np.uint8)
        self.host[int(arr.ctypes.data)] = arr
        return HostBuffer(int(arr.ctypes.data), nbytes, arr)

    def copy(self, moves: Sequence[Copy], to_device: bool) -> Fence:
        kind = "to_device" if to_device else "to_host"
        src_t, dst_t = (self.host, self.memory) if to_device else (self.memory, self.host)
        pairs = []
        for m in moves:
            src, dst = self._find(src_t, m.src, m.length), self._find(dst_t, m.dst, m.length)
            if src is None or dst is None:
                raise InvalidArgument(f"stand-in copy {m} outside registered memory")
            pairs.append((dst, src))
        with self._lock:
            index = self.batches[kind]
            self.batches[kind] += 1
            if self.skip[kind] > 0:
                self.skip[kind] -= 1
                fail = False
            else:
                fail = getattr(self, f"fail_{kind}") > 0
            if fail:
                setattr(self, f"fail_{kind}", getattr(self, f"fail_{kind}") - 1)
            self.log.append(("enqueue", kind, index))
        if fail and self.refuse:
            raise TransferFail(f"stand-in device refused a copy {kind}")
        if self._jobs is not None:
            return self._queue(kind, index, pairs, fail)
        if fail:
            self.note("failed", kind, index)
            return _FailedFence()

        def run() -> None:
            for dst, src in pairs:
                dst[:] = src
            self.note("done", kind, index)
        if self.lazy:
            return _LazyFence(run)
        run()
        return DONE

    def _queue(self, kind: str, index: int, pairs: list[tuple[np.ndarray, np.ndarray]],
               fail: bool) -> Fence:
        fence = _JobFence()

        def job() -> None:
            gate = self.gates.get((kind, index))
            if gate is not None:
                gate.wait()
            if self.stall is not None:
                self.stall.wait()
            self.note("run", kind, index)
            if fail:
                fence.failed = True
                self.note("failed", kind, index)
            else:
                for dst, src in pairs:
                    dst[:] = src
                self.note("done", kind, index)
            fence.done.set()
        assert self._jobs is not None
        self._jobs.put(job)
        return fence


class _Copier:
    """The copier ``copier_for`` builds for stand-in regions (their device's)."""

    def __init__(self, regions: Sequence[MemRegion]) -> None:
        self.dev = DEVICES[regions[0].device]
        self.device = self.dev.name

    def host_buffer(self, nbytes: int) -> HostBuffer:
        return self.dev.host_buffer(nbytes)

    def copy(self, moves: Sequence[Copy], to_device: bool) -> Fence:
        return self.dev.copy(moves, to_device)


def _copier(regions: Sequence[MemRegion]) -> _Copier:
    return _Copier(regions)


def vllm_caches(dev: StandinDevice, layer_names: Sequence[str], num_blocks: int, heads: int,
                block_size: int, head_dim: int, itemsize: int = 4,
                layout: str = "LBHNC") -> dict[str, StandinTensor]:
    """One backing allocation viewed as ``[B, H, N, C]`` per layer, strided as vLLM 0.32's
    ``allocate_kv_cache`` does: ``LBHNC`` (layer outermost) or ``BLHNC`` (block outermost)."""
    L = len(layer_names)
    page = heads * block_size * head_dim  # elements of one (block, layer) page
    alloc = dev.alloc(L * num_blocks * page * itemsize)
    inner = (block_size * head_dim, head_dim, 1)
    out = {}
    for i, name in enumerate(layer_names):
        if layout == "LBHNC":
            off, bstride = i * num_blocks * page, page
        elif layout == "BLHNC":
            off, bstride = i * page, L * page
        else:
            raise InvalidArgument(f"layout {layout}")
        out[name] = dev.tensor((num_blocks, heads, block_size, head_dim), (bstride, *inner),
                               itemsize, alloc, off * itemsize)
    return out
