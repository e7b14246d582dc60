"""Registration of local memory as (address, length) regions, with bounds checks.

Accepts numpy arrays, bytearray, mmap, torch tensors (CPU, or on a device: then a region of
kind "dev" with no host view) and raw (address, length). Every
lookup checks that a whole range lies inside one region before any byte is touched.
Does not import transports or the engine.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import secrets
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvplane.common.errors import AddressNotRegistered, Conflict, InvalidArgument, NotFound
from kvplane.transfer.types import RegionDesc, RegionKind

FILE_BASE = 0x7E00_0000_0000_0000  # synthetic address space for file-backed regions
FILE_STRIDE = 1 << 44


@dataclass(eq=False)
class Region:
    """One registered region. ``view`` is a writable byte memoryview over it (None for files)."""

    addr: int
    length: int
    view: memoryview | None
    kind: str = RegionKind.MEM  # a RegionKind value
    shm: str = ""
    path: str = ""
    fd: int = -1
    keep: Any = field(default=None, repr=False)
    fenced: bool = False
    device: str = ""  # "" host memory; else the device holding it ("cuda:0", "standin:0")

    @property
    def end(self) -> int:
        return self.addr + self.length

    def desc(self) -> RegionDesc:
        """The descriptor peers see."""
        return RegionDesc(self.addr, self.length, self.kind, self.shm,
                          os.path.basename(self.path) if self.path else "",
                          file_identity(self.fd) if self.fd >= 0 else "", fenced=self.fenced,
                          device=self.device)


def file_identity(fd_or_path: int | str) -> str:
    """``"dev:inode"`` of an open file or a path: equal only for the very same file."""
    st = os.fstat(fd_or_path) if isinstance(fd_or_path, int) else os.stat(fd_or_path)
    return f"{st.st_dev}:{st.st_ino}"


def view_at(addr: int, length: int) -> memoryview:
    """A writable byte view of raw memory at ``addr`` (the caller vouches for it)."""
    if length == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")


def address_of(obj: Any) -> tuple[int, int, Any]:
    """(address, length, keep-alive) of a buffer-like object.

    Raises:
        InvalidArgument: for read-only, non-contiguous or unsupported objects.
    """
    if isinstance(obj, tuple) and len(obj) == 2 and all(isinstance(x, int) for x in obj):
        return obj[0], obj[1], None
    mod = type(obj).__module__
    if mod.startswith("torch"):
        if obj.device.type != "cpu" or not obj.is_contiguous():
            raise InvalidArgument("only contiguous CPU tensors can be registered")
        return int(obj.data_ptr()), int(obj.numel() * obj.element_size()), obj
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous or not obj.flags.writeable:
            raise InvalidArgument("numpy arrays must be C-contiguous and writeable")
        return int(obj.ctypes.data), int(obj.nbytes), obj
    if isinstance(obj, (bytearray, mmap.mmap, memoryview)):
        mv = memoryview(obj)
        if mv.readonly or not mv.contiguous:
            raise InvalidArgument("buffer must be writable and contiguous")
        arr = np.frombuffer(mv, dtype=np.uint8)
        return int(arr.ctypes.data), mv.nbytes, (obj, arr)
    raise InvalidArgument(f"cannot register {type(obj).__name__}: pass numpy, bytearray, mmap, "
                          "torch CPU tensor or (address, length)")


def buffer_of(obj: Any, device: str = "") -> tuple[int, int, Any, str]:
    """(address, length, keep-alive, device) of a buffer-like object; ``device`` is "" for
    host memory.

    A contiguous torch tensor on a device (any but "cpu") gives its device address and
    ``str(tensor.device)``; a raw ``(address, length)`` is device memory when ``device`` names
    one (``"standin:0"``, ``"cuda:0"``). Anything else is host memory, as :func:`address_of`.

    Raises:
        InvalidArgument: a non-contiguous device tensor, ``device`` given with a buffer that
            knows its own device, or what :func:`address_of` refuses.
    """
    if type(obj).__module__.startswith("torch") and obj.device.type != "cpu":
        if not obj.is_contiguous():
            raise InvalidArgument("only contiguous device tensors can be registered")
        if device and device != str(obj.device):
            raise InvalidArgument(f"a tensor on {obj.device} registered as {device}")
        return int(obj.data_ptr()), int(obj.numel() * obj.element_size()), obj, str(obj.device)
    is_raw = isinstance(obj, tuple)
    if device and not is_raw:
        raise InvalidArgument("device= is for raw (address, length) device memory only")
    addr, n, keep = address_of(obj)
    return addr, n, keep, device


SHM_DIR = "/dev/shm"
SHM_PREFIX = "kvplane-"
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+


def sweep_stale_shm() -> int:
    """Unlink managed buffers left by processes that died without cleaning up (kill -9).

    Names are ``kvplane-<pid>-<random>``; a file whose pid no longer exists is removed.
    Returns how many were removed.
    """
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        parts = name.split("-")
        if not name.startswith(SHM_PREFIX) or len(parts) != 3 or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        try:
            os.kill(pid, 0)
            continue  # alive (or not ours to signal): keep
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed += 1
        except OSError:
            pass
    return removed


def _unlink_quietly(path: str, owner: int) -> None:
    if os.getpid() != owner:
        return  # a forked child exiting: the file is its parent's
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class ManagedBuffer:
    """Memory backed by POSIX shared memory (``/dev/shm/kvplane-<pid>-<id>``, mode 0600), so
    same-host peers can map it.

    Attributes:
        addr: start address in this process.
        length: usable bytes.
        name: the shared-memory name peers open.
        array: a uint8 numpy view of the memory.
    """

    def __init__(self, length: int, populate: bool = False) -> None:
        if length <= 0:
            raise InvalidArgument("managed buffer length must be > 0")
        self.name = f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        self._path = os.path.join(SHM_DIR, self.name)
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        # a buffer nobody closed still leaves /dev/shm: when collected, or at interpreter exit
        self._unlink = weakref.finalize(self, _unlink_quietly, self._path, os.getpid())
        try:
            os.ftruncate(fd, length)
            self._mmap: mmap.mmap | None = mmap.mmap(fd, length)
        except BaseException:
            self._unlink()
            raise
        finally:
            os.close(fd)
        self.length = length
        self.array = np.frombuffer(self._mmap, dtype=np.uint8, count=length)
        if populate:  # fault every page in now, not on the first write into it
            try:
                self._mmap.madvise(_MADV_POPULATE_WRITE)
            except OSError:  # kernels before 5.14: touch one byte per page
                self.array[::mmap.PAGESIZE] = 0
        self.addr = int(self.array.ctypes.data)

    def close(self) -> None:
        """Unlink the name and release the mapping once no view needs it (idempotent)."""
        if self._mmap is None:
            return
        self._unlink()
        self.array = None  # type: ignore[assignment]  # closed: a later use fails loudly
        mm, self._mmap = self._mmap, None
        try:
            mm.close()
        except BufferError:
            pass  # a live view still exists; the mapping goes when it does


class MemoryTable:
    """Registered regions of one engine, sorted by address. Thread-safe.

    Lookups are O(log n) and check the whole [addr, addr+length) range.
    """

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._regions: list[Region] = []
        self._lock = threading.Lock()
        self._next_file = 0
        self.version = 0  # bumped by every add and remove (a cache of a lookup checks it)

    def add(self, region: Region) -> Region:
        """Insert a region.

        Raises:
            Conflict: if it overlaps a registered region (Mooncake ERR_ADDRESS_OVERLAPPED).
            InvalidArgument: for an empty or negative region.
        """
        if region.length <= 0 or region.addr <= 0:
            raise InvalidArgument(f"bad region addr={region.addr:#x} length={region.length}")
        with self._lock:
            i = bisect.bisect_left(self._starts, region.addr)
            prev = self._regions[i - 1] if i > 0 else None
            nxt = self._regions[i] if i < len(self._regions) else None
            if (prev and prev.end > region.addr) or (nxt and nxt.addr < region.end):
                raise Conflict(f"region {region.addr:#x}+{region.length} overlaps a registered one")
            self._starts.insert(i, region.addr)
            self._regions.insert(i, region)
            self.version += 1
        return region

    def remove(self, addr: int) -> Region:
        """Remove the region starting at ``addr``.

        Raises:
            NotFound: if no region starts there.
        """
        with self._lock:
            i = bisect.bisect_left(self._starts, addr)
            if i == len(self._starts) or self._starts[i] != addr:
                raise NotFound(f"no region registered at {addr:#x}")
            del self._starts[i]
            self.version += 1
            return self._regions.pop(i)

    def find(self, addr: int, length: int) -> Region:
        """The region holding all of [addr, addr+length).

        Raises:
            AddressNotRegistered: otherwise (no memory is touched).
        """
        if length < 0 or addr < 0:
            raise AddressNotRegistered(f"bad range {addr:#x}+{length}")
        with self._lock:
            i = bisect.bisect_right(self._starts, addr) - 1
            r = self._regions[i] if i >= 0 else None
        if r is not None and addr + length <= r.end:
            return r
        raise AddressNotRegistered(f"range {addr:#x}+{length} is not inside a registered region")

    def view(self, addr: int, length: int) -> memoryview:
        """Bounds-checked writable view of [addr, addr+length) (memory regions only)."""
        r = self.find(addr, length)
        if r.view is None:
            raise InvalidArgument(f"{addr:#x} is in a {r.kind} region; it has no memory view")
        off = addr - r.addr
        return r.view[off:off + length]

    def next_file_base(self) -> int:
        """A fresh synthetic base address for a file region."""
        with self._lock:
            base = FILE_BASE + self._next_file * FILE_STRIDE
            self._next_file += 1
            return base

    def regions(self) -> list[Region]:
        """A snapshot of the regions, sorted by address."""
        with self._lock:
            return list(self._regions)

    def descs(self) -> list[RegionDesc]:
        """Descriptors of every region."""
        return [r.desc() for r in self.regions()]
