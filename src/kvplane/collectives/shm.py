"""Shared-memory areas of one process group, for allreduce between ranks on one host.

Every rank of a kvplane group runs on the same host (the mesh binds 127.0.0.1), so an allreduce
can read its peers' inputs from shared memory instead of streaming them through loopback TCP
(two kernel copies per byte per ring step). Each rank owns one area: a file in ``/dev/shm`` named
by its pid, incarnation id and a generation, ``kvplane-pg-<pid>-<inc>-<gen>``. Its first ``cap``
bytes hold the rank's published input (which doubles as the copy an exact restart needs), the
rest the block of the result this rank reduced. Peers map an area when an op first needs it.

Lifetime: space is reserved with ``posix_fallocate`` when a file is created, so a full
``/dev/shm`` is an error here (the caller falls back to the TCP ring), never a SIGBUS later. Once
an op has completed through an area every participant has it mapped, and its owner removes the
file (:meth:`ShmArena.settle`): the memory lives on in the mappings and goes with the processes,
so even kill -9 leaves nothing behind. A peer that could not map an area (it joined later, say)
makes the op fall back to the ring, and every owner then starts a new generation
(:meth:`ShmArena.renew`). Files of an owner that died before its first op completed are removed
by the survivors (:meth:`ShmArena.forget`) or by the next arena created on the host. Nothing here
talks to peers: agreeing who published what is the caller's job (:mod:`.ops`).
"""

from __future__ import annotations

import logging
import mmap
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_MIN_CAP = 1 << 20


def _cap(nbytes: int) -> int:
    """The size class of an ``nbytes`` input: at least 1 MiB, else rounded up to a multiple of
    an eighth of the power of two above it (at most 25 % more than asked)."""
    if nbytes <= _MIN_CAP:
        return _MIN_CAP
    step = 1 << max(0, (nbytes - 1).bit_length() - 3)
    return -(-nbytes // step) * step


def _path(pid: int, inc: int, gen: int) -> str:
    return os.path.join(SHM_DIR, f"kvplane-pg-{pid}-{inc:08x}-{gen}")


def _areas_on_host() -> Iterator[tuple[str, int, str]]:
    """``(path, owner pid, incarnation as named)`` of every area file in :data:`SHM_DIR`."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if len(parts) == 5 and parts[:2] == ["kvplane", "pg"] and parts[2].isdigit():
            yield os.path.join(SHM_DIR, name), int(parts[2]), parts[3]


def _sweep() -> None:
    """Remove areas whose owner process is gone."""
    for path, pid, _ in _areas_on_host():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            _unlink(path)
        except OSError:  # alive, another user's
            pass


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _unlink_all(paths: set[str]) -> None:
    for path in list(paths):
        _unlink(path)


@dataclass(frozen=True)
class AreaId:
    """What names an area and what a peer needs to map it (sent to peers as one integer)."""

    pid: int
    gen: int
    cap: int

    def pack(self) -> int:
        """As one unsigned 128-bit integer (never 0)."""
        return self.cap | self.gen << 64 | self.pid << 96

    @staticmethod
    def unpack(v: int) -> AreaId:
        return AreaId(pid=v >> 96, gen=v >> 64 & 0xFFFFFFFF, cap=v & (1 << 64) - 1)


class Area:
    """One mapped area: ``inputs`` (``cap`` bytes) and ``result`` (a block) as uint8 tensors."""

    def __init__(self, path: str, cap: int, create: bool) -> None:
        size = cap + cap // 2 + 64  # a participant's block is at most ceil(numel / 2) elements
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.posix_fallocate(fd, 0, size)  # ENOSPC now rather than SIGBUS on first touch
            elif os.fstat(fd).st_size < size:
                raise OSError(f"{path} is smaller than {size} bytes")
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            if create:
                _unlink(path)
            raise
        finally:
            os.close(fd)
        self.path, self.cap = path, cap
        whole = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.inputs, self.result = whole[:cap], whole[cap:]

    def close(self) -> None:
        """Unmap (now, or when the last tensor view of it goes)."""
        self.inputs = self.result = None  # type: ignore[assignment]  # closed: no views
        try:
            self.mm.close()
        except BufferError:
            pass


class ShmArena:
    """This rank's area and the areas of its peers it mapped, by peer incarnation id.

    Args:
        inc: this rank's incarnation id.
    """

    def __init__(self, inc: int) -> None:
        self.inc, self.pid = inc, os.getpid()
        self.id: AreaId | None = None  # this rank's area
        self._own: Area | None = None
        self._gen = 0
        self._linked: set[str] = set()  # own files not removed yet (also the exit hook's set)
        self._peers: dict[int, tuple[AreaId, Area]] = {}
        self.refused = 0  # smallest size class some participant had no room for (0: none yet)
        weakref.finalize(self, _unlink_all, self._linked)
        _sweep()

    def own(self, nbytes: int) -> Area | None:
        """This rank's area, replaced by a bigger one if it cannot hold ``nbytes``; None if
        ``/dev/shm`` has no room for it."""
        cap = _cap(nbytes)
        if self._own is not None and self._own.cap >= nbytes:
            return self._own
        if self.refused and cap >= self.refused:
            return None
        self.renew()
        self._gen += 1
        path = _path(self.pid, self.inc, self._gen)
        try:
            self._own = Area(path, cap, create=True)
        except OSError as exc:
            log.warning("no shared-memory allreduce area of %d bytes (%s): using the TCP ring", cap, exc)
            return None
        self._linked.add(path)
        self.id = AreaId(self.pid, self._gen, cap)
        return self._own

    def refuse(self, nbytes: int) -> None:
        """A participant had no room for ``nbytes``: drop this rank's unused area and take
        inputs of this size class and up over the ring from now on (for this group)."""
        cap = _cap(nbytes)
        self.refused = cap if not self.refused else min(self.refused, cap)
        if self._own is not None and self._own.cap >= cap:
            self.renew()

    def settle(self) -> None:
        """An op completed through this rank's area, so every participant mapped it: remove
        its file (the mappings keep the memory)."""
        if self._own is not None and self._own.path in self._linked:
            _unlink(self._own.path)
            self._linked.discard(self._own.path)

    def renew(self) -> None:
        """Drop this rank's area; the next op creates a new generation (after a peer could
        not map it)."""
        if self._own is not None:
            _unlink(self._own.path)
            self._linked.discard(self._own.path)
            self._own.close()
            self._own, self.id = None, None

    def peer(self, inc: int, aid: AreaId) -> Area | None:
        """The area ``aid`` of the peer with incarnation ``inc`` (mapped on first use); None
        if it cannot be mapped."""
        known = self._peers.get(inc)
        if known is not None and known[0] == aid:
            return known[1]
        try:
            area = Area(_path(aid.pid, inc, aid.gen), aid.cap, create=False)
        except (OSError, ValueError) as exc:
            log.info("shared-memory area of peer %08x not mapped (%s): using the TCP ring", inc, exc)
            return None
        if known is not None:
            known[1].close()
        self._peers[inc] = (aid, area)
        return area

    def forget(self, inc: int) -> None:
        """Unmap a dead peer's area and remove its file if it still exists."""
        known = self._peers.pop(inc, None)
        if known is not None:
            known[1].close()
        for path, _, named in _areas_on_host():
            if named == f"{inc:08x}":
                _unlink(path)

    def close(self) -> None:
        """Unmap everything and remove this rank's file (idempotent)."""
        self.renew()
        for _, area in self._peers.values():
            area.close()
        self._peers.clear()
