"""Same-host transport: a direct copy between this process and the target's memory.

* ``shm`` regions (POSIX shared memory) are mapped once and copied with memcpy.
* other memory regions are copied with ``process_vm_readv``/``process_vm_writev`` (Linux
  cross-memory attach), one kernel copy and no socket. If the kernel refuses (ptrace policy),
  the transport says it cannot reach the target and the engine falls back to TCP.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import threading

import numpy as np

from kvplane.common.deadline import Deadline
from kvplane.transfer.batch import Slice
from kvplane.transfer.transports.base import Capabilities, Route, Transport, TransportContext
from kvplane.transfer.types import OpCode, RegionDesc, TransferStatus

SHM_DIR = "/dev/shm"
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+
_SHM_NAME = re.compile(r"^kvplane-[0-9]+-[0-9a-f]+$")  # only our own managed buffers

_libc = ctypes.CDLL(None, use_errno=True)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _cma(pid: int, local_addr: int, remote: int, length: int, write: bool) -> None:
    """Copy with process_vm_{read,write}v; raises OSError on failure."""
    done = 0
    fn = _libc.process_vm_writev if write else _libc.process_vm_readv
    while done < length:
        lv = _IoVec(local_addr + done, length - done)
        rv = _IoVec(remote + done, length - done)
        n = fn(pid, ctypes.byref(lv), 1, ctypes.byref(rv), 1, 0)
        if n <= 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_{'writev' if write else 'readv'}: {os.strerror(err)}")
        done += n


def _addr_of(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


class ShmTransport(Transport):
    """Copies between same-host processes without touching a socket."""

    name = "shm"
    capabilities = Capabilities(same_host_only=True, priority=3)

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self._maps: dict[str, tuple[mmap.mmap, np.ndarray]] = {}
        self._lock = threading.Lock()
        self._cma_ok: bool | None = None

    def can_reach(self, route: Route) -> bool:
        if not route.same_host or route.region.kind == "file":
            return False
        if route.region.kind == "shm":
            return _SHM_NAME.match(route.region.shm) is not None and \
                os.path.exists(os.path.join(SHM_DIR, route.region.shm))
        return self._probe_cma(route.segment.pid)

    def _probe_cma(self, pid: int) -> bool:
        if self._cma_ok is None:
            probe = np.zeros(1, np.uint8)
            try:  # read our own byte: tells whether the kernel allows CMA at all
                _cma(os.getpid(), probe.ctypes.data, probe.ctypes.data, 1, write=False)
                self._cma_ok = True
            except OSError:
                self._cma_ok = False
        return self._cma_ok and pid > 0

    def _mapped(self, region: RegionDesc) -> np.ndarray:
        with self._lock:
            hit = self._maps.get(region.shm)
            if hit is None:
                if not _SHM_NAME.match(region.shm):
                    raise ValueError(f"refusing shared-memory name {region.shm!r}")
                fd = os.open(os.path.join(SHM_DIR, region.shm), os.O_RDWR | os.O_NOFOLLOW)
                try:
                    mm = mmap.mmap(fd, region.length)
                finally:
                    os.close(fd)
                try:  # map every page now: no minor fault per page on the data path later
                    mm.madvise(_MADV_POPULATE_WRITE)
                except OSError:
                    pass
                hit = (mm, np.frombuffer(mm, dtype=np.uint8))
                self._maps[region.shm] = hit
            return hit[1]

    def run(self, route: Route, slices: list[Slice], deadline: Deadline) -> None:
        region = route.region
        for s in slices:
            if deadline.expired():
                s.done(TransferStatus.TIMEOUT, "deadline passed")
                continue
            try:
                if region.kind == "shm":
                    arr = self._mapped(region)
                    off = s.remote - region.addr
                    remote = arr[off:off + s.length]
                    local = np.frombuffer(s.local, dtype=np.uint8)
                    if s.op == OpCode.WRITE:
                        np.copyto(remote, local)
                    else:
                        np.copyto(local, remote)
                else:
                    _cma(route.segment.pid, _addr_of(s.local), s.remote, s.length,
                         write=s.op == OpCode.WRITE)
            except (OSError, ValueError) as exc:
                s.done(TransferStatus.FAILED, f"same-host copy failed: {exc}")
                continue
            s.done(TransferStatus.COMPLETED)

    def forget(self, shm_name: str) -> None:
        """Drop a cached mapping (the owner freed or re-created it)."""
        with self._lock:
            hit = self._maps.pop(shm_name, None)
        if hit is not None:
            try:
                hit[0].close()
            except BufferError:
                pass

    def close(self) -> None:
        with self._lock:
            names = list(self._maps)
        for n in names:
            self.forget(n)
