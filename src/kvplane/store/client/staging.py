"""Registered staging memory for the bytes API: carve, use, give back. Thread-safe.

Besides blocks carved per call (``take``, ``block``), each thread that puts small objects keeps
one ``SLOT`` of its own (``slot``): a small put copies its header and value there and sends them
in one WRITE without an allocation. The slot goes back to the buffer when its thread ends.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from kvplane.store.master.allocator import OffsetAllocator
from kvplane.transfer import TransferEngine

SLOT = 72 << 10  # a thread's own staging: a small put's header (<= 4.1 KiB) and value (<= 64 KiB)


class _Slot:
    """One thread's ``SLOT`` bytes: address, uint8 view and byte view (freed with the thread's
    locals, when the thread ends, by a finalizer)."""

    __slots__ = ("addr", "array", "mem", "__weakref__")

    def __init__(self, addr: int, array: np.ndarray) -> None:
        self.addr, self.array, self.mem = addr, array, array.data.cast("B")


class Staging:
    """Blocks of a shared-memory buffer registered with the engine; oversized requests get a
    temporary registered buffer of their own."""

    def __init__(self, engine: TransferEngine, size: int) -> None:
        self._te = engine
        self._buf = engine.allocate_managed_buffer(size) if size > 0 else None
        self._alloc = OffsetAllocator(size) if size > 0 else None
        self._lock = threading.Lock()
        self._local = threading.local()
        self._slot_room = size // 4  # slots take at most a quarter: the rest is for blocks

    def slot(self) -> _Slot | None:
        """This thread's own ``SLOT`` registered bytes, carved the first time and kept while the
        thread lives (one small write at a time, by this thread only); None without room
        (slots together take at most a quarter of the buffer)."""
        got: _Slot | None = getattr(self._local, "slot", None)
        if got is not None or self._alloc is None:
            return got
        alloc = self._alloc
        with self._lock:
            off = alloc.allocate(SLOT) if self._slot_room >= SLOT else None
            if off is not None:
                self._slot_room -= SLOT
        if off is None:
            return None
        assert self._buf is not None
        got = self._local.slot = _Slot(self._buf.addr + off, self._buf.array[off:off + SLOT])
        weakref.finalize(got, self._free, alloc, off, SLOT)
        return got

    def _free(self, alloc: OffsetAllocator, off: int, n: int) -> None:
        with self._lock:
            alloc.free(off, n)
            self._slot_room += n

    def take(self, n: int, spill: bool = True) -> tuple[int, np.ndarray, Callable[[], None]] | None:
        """(address, uint8 view, release) of ``n`` registered bytes that stay the caller's until
        it calls ``release`` (once). Without room: a temporary registered buffer if ``spill``,
        else None."""
        off = None
        if self._alloc is not None and n > 0:
            with self._lock:
                off = self._alloc.allocate(n)
        if off is not None:
            assert self._buf is not None and self._alloc is not None
            alloc = self._alloc

            def give_back() -> None:
                with self._lock:
                    alloc.free(off, n)
            return self._buf.addr + off, self._buf.array[off:off + n], _once(give_back)
        if not spill:
            return None
        tmp = np.empty(max(n, 1), np.uint8)
        region = self._te.register_memory(tmp, publish=False)
        return region.addr, tmp[:n], _once(lambda: self._te.unregister_memory(region.addr,
                                                                             publish=False))

    @contextmanager
    def block(self, n: int) -> Iterator[tuple[int, np.ndarray]]:
        """Yield (address, uint8 view) of ``n`` registered bytes, freed on exit."""
        off = None
        if self._alloc is not None and n > 0:
            with self._lock:
                off = self._alloc.allocate(n)
        if off is not None:
            assert self._buf is not None and self._alloc is not None
            alloc = self._alloc
            try:
                yield self._buf.addr + off, self._buf.array[off:off + n]
            finally:
                with self._lock:
                    alloc.free(off, n)
            return
        tmp = np.empty(max(n, 1), np.uint8)
        region = self._te.register_memory(tmp, publish=False)  # local-only: no metadata write
        try:
            yield region.addr, tmp[:n]
        finally:
            self._te.unregister_memory(region.addr, publish=False)


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    done = threading.Lock()

    def call() -> None:
        if done.acquire(blocking=False):
            fn()
    return call
