"""Same-host transport: a direct copy between this process and the target's memory.

* ``shm`` regions (POSIX shared memory) are mapped once and copied with memcpy.
* other memory regions are copied with ``process_vm_readv``/``process_vm_writev`` (Linux
  cross-memory attach), one kernel copy and no socket. If the kernel refuses (ptrace policy),
  the transport says it cannot reach the target and the engine falls back to TCP.

A mapping is tied to its owner process through a pidfd: once the owner has exited, slices to
it fail (the engine then tries TCP, which is refused) instead of landing in a dead process's
memory, and the mapping is dropped, so dead segments cost no memory (``prune`` drops every
dead one). In a ``fenced`` region (a store segment) a slice's generation is checked against the
owner's fence floor, published in the region's first 8 bytes, before and after the copy: a
writer holding an allocation of a deposed master or of an older mount is refused. A slice that
carries a store generation is checked against its deadline before and after the copy: no
server mediates here, so a copy that finished past the allocation's window is reported
TIMEOUT, never COMPLETED (the master keeps freed space out of reuse until every window granted
on it has passed).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import select
import threading

import numpy as np

from kvplane.common.deadline import Deadline
from kvplane.transfer.batch import Slice
from kvplane.transfer.fence import FENCE_BYTES, admits, admits_words
from kvplane.transfer.seam import Capabilities, Route, Transport, TransportContext
from kvplane.transfer.types import OpCode, RegionDesc, TransferStatus

SHM_DIR = "/dev/shm"
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


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _addr_of(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


class _Owner:
    """The process that owns a mapping, watched through a pidfd (exit makes it readable)."""

    __slots__ = ("fd", "_poll", "_lock")

    def __init__(self, pid: int) -> None:
        self.fd = os.pidfd_open(pid)  # raises ProcessLookupError when it is gone
        self._poll = select.poll()
        self._poll.register(self.fd, select.POLLIN)
        self._lock = threading.Lock()  # a poll object takes one caller at a time

    def alive(self) -> bool:
        with self._lock:
            return not self._poll.poll(0)

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


class ShmTransport(Transport):
    """Copies between same-host processes without touching a socket."""

    name = "shm"
    capabilities = Capabilities(same_host_only=True, priority=3, fallbacks=("tcp",))

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self._maps: dict[str, tuple[mmap.mmap, np.ndarray, _Owner]] = {}
        self._lock = threading.Lock()
        self._cma_ok: bool | None = None

    def can_reach(self, route: Route) -> bool:
        if not route.same_host or route.region.kind in ("file", "dev"):
            return False  # device memory cannot be mapped nor read with CMA: its listener serves it
        if route.region.kind == "shm":
            with self._lock:
                hit = self._maps.get(route.region.shm)
            if hit is not None:
                return hit[2].alive()
            return _SHM_NAME.match(route.region.shm) is not None and \
                os.path.exists(os.path.join(SHM_DIR, route.region.shm)) and \
                _pid_alive(route.segment.pid)
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

    def _mapped(self, region: RegionDesc, pid: int) -> np.ndarray:
        """The mapping of ``region``; raises OSError once its owner ``pid`` has exited."""
        with self._lock:
            hit = self._maps.get(region.shm)
        if hit is not None and not hit[2].alive():
            self.forget(region.shm)
            raise OSError(f"the process owning {region.shm} has exited")
        if hit is None:
            hit = self._map(region, pid)
        return hit[1]

    def _map(self, region: RegionDesc, pid: int) -> tuple[mmap.mmap, np.ndarray, _Owner]:
        if not _SHM_NAME.match(region.shm):
            raise ValueError(f"refusing shared-memory name {region.shm!r}")
        owner = _Owner(pid)
        fd = os.open(os.path.join(SHM_DIR, region.shm), os.O_RDWR | os.O_NOFOLLOW)
        try:
            mm = mmap.mmap(fd, region.length)
        finally:
            os.close(fd)
        # Pages are mapped on first touch, not all now: the owner populated them, so each
        # first touch is a minor fault (with fault-around). Populating the whole region here
        # cost a first contact 27 ms for 256 MiB, for a 4 KiB read; a first full 256 MiB
        # read then ran 22 ms after those 27, against 35 ms touching lazily (docs/transfer.md).
        hit = (mm, np.frombuffer(mm, dtype=np.uint8), owner)
        with self._lock:
            old = self._maps.setdefault(region.shm, hit)
        if old is not hit:  # another thread mapped it first
            _unmap(hit)
        return old

    def run(self, route: Route, slices: list[Slice], deadline: Deadline) -> None:
        region = route.region
        arr = None
        for s in slices:
            if deadline.expired():
                s.done(TransferStatus.TIMEOUT, "deadline passed")
                continue
            try:
                if region.kind == "shm":
                    if arr is None:  # one liveness check per run, not per slice
                        arr = self._mapped(region, route.segment.pid)
                    done = _copy_fenced(arr, region, s.op, s.remote, s.length, s.local,
                                        s.task.req.gen)
                    if done == _REFUSED:
                        s.done(TransferStatus.FAILED, "fenced: the segment serves another "
                               "master epoch or a newer mount")
                        continue
                    if done == _FENCED:
                        s.done(TransferStatus.FAILED, "fenced during the copy")
                        continue
                else:
                    _cma(route.segment.pid, _addr_of(s.local), s.remote, s.length,
                         write=s.op == OpCode.WRITE)
            except (OSError, ValueError) as exc:
                s.done(TransferStatus.FAILED, f"same-host copy failed: {exc}")
                continue
            if s.task.req.gen and deadline.expired():  # finished past the allocation's window
                s.done(TransferStatus.TIMEOUT, "copy finished past its deadline")
                continue
            s.done(TransferStatus.COMPLETED)

    def copy_one(self, op: OpCode, route: Route, view: memoryview, remote: int, gen: int,
                 deadline: Deadline) -> TransferStatus | None:
        """One READ or WRITE of a mapped ``shm`` region (``MappedOneIO``), checked as ``run``
        checks a slice: the owner alive, the fence before and after the copy, the deadline
        after it when ``gen`` is set. None, with nothing moved, for a CMA region, an owner
        gone or a fence that refuses ``gen`` (the engine's batch path reports those)."""
        region = route.region
        if region.kind != "shm":
            return None
        if deadline.expired():
            return TransferStatus.TIMEOUT
        try:
            arr = self._mapped(region, route.segment.pid)
        except (OSError, ValueError):
            return None
        done = _copy_fenced(arr, region, op, remote, len(view), view, gen)
        if done == _REFUSED:
            return None
        if done == _FENCED:
            return TransferStatus.FAILED
        if gen and deadline.expired():  # finished past the allocation's window
            return TransferStatus.TIMEOUT
        return TransferStatus.COMPLETED

    def forget(self, shm_name: str) -> None:
        """Drop a cached mapping (the owner freed or re-created it)."""
        with self._lock:
            hit = self._maps.pop(shm_name, None)
        if hit is not None:
            _unmap(hit)

    def prune(self) -> int:
        """Unmap every mapping whose owner process has exited; returns how many went."""
        with self._lock:
            dead = [n for n, hit in self._maps.items() if not hit[2].alive()]
        for name in dead:
            self.forget(name)
        return len(dead)

    def mapped(self) -> list[str]:
        """Names of the shared-memory regions mapped now."""
        with self._lock:
            return list(self._maps)

    def close(self) -> None:
        with self._lock:
            names = list(self._maps)
        for n in names:
            self.forget(n)


_REFUSED, _FENCED, _COPIED = 0, 1, 2  # how _copy_fenced ended


def _copy_fenced(arr: np.ndarray, region: RegionDesc, op: OpCode, remote: int, length: int,
                 local: memoryview, gen: int) -> int:
    """Copy ``length`` bytes between ``local`` and ``remote`` in the mapped ``region``
    (``arr``) under its fence: ``_REFUSED`` (the fence refuses ``gen``: nothing moved),
    ``_FENCED`` (it refused ``gen`` once the copy was done) or ``_COPIED``."""
    if region.fenced and not _admitted(arr, gen):
        return _REFUSED
    off = remote - region.addr
    far = arr[off:off + length]
    near = np.frombuffer(local, dtype=np.uint8)
    if op == OpCode.WRITE:
        np.copyto(far, near)
    else:
        np.copyto(near, far)
    if region.fenced and not _admitted(arr, gen):
        return _FENCED
    return _COPIED


def _admitted(arr: np.ndarray, gen: int) -> bool:
    """The owner's fence (its lanes' floors, published in the region's first ``FENCE_BYTES``:
    lane 0 first, the only one in use without master shards) admits ``gen``."""
    first = int.from_bytes(arr[:8].tobytes(), "little")
    if first and first >> 40 == gen >> 40:  # lane 0 serves this epoch (one master: always)
        return admits(first, gen)
    return admits_words(arr[:FENCE_BYTES].view("<u8").tolist(), gen)


def _unmap(hit: tuple[mmap.mmap, np.ndarray, _Owner]) -> None:
    """Release a mapping: its array view first, so the unmap happens now (if no slice still
    holds a view, else when the last one goes)."""
    mm, _, owner = hit
    owner.close()
    del hit
    try:
        mm.close()
    except BufferError:
        pass
