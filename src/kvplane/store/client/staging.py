"""Registered staging memory for the bytes API: carve, use, give back. Thread-safe."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from kvplane.store.master.allocator import OffsetAllocator
from kvplane.transfer import TransferEngine


class Staging:
    """Blocks of a shared-memory buffer registered with the engine; oversized requests get a
    temporary registered buffer of their own."""

    def __init__(self, engine: TransferEngine, size: int) -> None:
        self._te = engine
        self._buf = engine.allocate_managed_buffer(size) if size > 0 else None
        self._alloc = OffsetAllocator(size) if size > 0 else None
        self._lock = threading.Lock()

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
