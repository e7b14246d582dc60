"""Mooncake's ``BufferPool``: scratch buffers leased from a store's local buffer for the
zero-copy calls (``mooncake.buffer_pool.BufferPool``, also ``mooncake.BufferPool``).

``acquire(size)`` (or ``buffer(size)``, a context manager) returns a ``BufferLease`` with
``ptr``, ``size``, ``buffer`` (a memoryview of ``size`` bytes) and ``release()``. A lease comes
from the store's setup-time local buffer when it has room, else from an overflow buffer
registered for the lease's lifetime; ``max_bytes`` bounds both together (default: the local
buffer twice), ``max_regions`` the number of live leases. When exhausted, ``acquire`` waits
(``block``/``timeout``, default ``block_on_exhaustion``/``default_timeout``) or raises
RuntimeError("... exhausted"). ``release()`` refuses while memoryviews of the lease are alive,
``close()`` while leases are; a lease that is garbage collected releases itself.

Imports only the facade's client plumbing.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from typing import Any

import numpy as np

MAX_LEASE = 1 << 48  # bytes one lease may ask for (a guard against size arithmetic overflow)


class BufferLease:
    """One leased buffer (see the module docstring)."""

    def __init__(self, pool: BufferPool, ptr: int, size: int, release: Any, nbytes: int) -> None:
        self.ptr, self.size = ptr, size
        self._pool, self._release, self._nbytes = pool, release, nbytes
        self._owner = (ctypes.c_ubyte * size).from_address(ptr) if size else bytearray(0)
        self._released = False

    @property
    def buffer(self) -> memoryview:
        if self._released:
            raise RuntimeError("the lease was released")
        return memoryview(self._owner).cast("B")

    def release(self) -> None:
        """Give the memory back (idempotent). Raises RuntimeError while views are alive."""
        if self._released:
            return
        if sys.getrefcount(self._owner) > 2:  # ours + getrefcount's argument
            raise RuntimeError("cannot release a lease while exported views of it are alive")
        self._released = True
        self._release()
        self._pool._returned(self._nbytes)

    def __enter__(self) -> BufferLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        try:
            if not self._released:
                self._released = True
                self._release()
                self._pool._returned(self._nbytes)
        except Exception:  # interpreter shutdown
            pass


class BufferPool:
    """Leases of registered scratch memory for one store (see the module docstring)."""

    def __init__(self, store: Any, max_bytes: int = 0, min_size_class: int = 65536,
                 max_size_class: int | None = None, alignment: int = 8388608,
                 block_on_exhaustion: bool = True, default_timeout: float | None = None,
                 max_regions: int | None = None, prewarm_size: int | None = None,
                 prewarm_count: int = 0) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise RuntimeError(f"alignment must be a power of two, got {alignment}")
        if getattr(store, "_c", None) is None:
            raise RuntimeError("MooncakeDistributedStore is not initialized")
        self._store = store
        local = int(getattr(store, "_local_buffer", 0))
        self.max_bytes = max_bytes or 2 * max(local, 1 << 20)
        self.min_size_class, self.max_size_class = min_size_class, max_size_class
        self.alignment = alignment
        self.block_on_exhaustion, self.default_timeout = block_on_exhaustion, default_timeout
        self.max_regions = max_regions
        self._cond = threading.Condition()
        self._active = 0
        self._bytes = 0
        self._closed = False
        if prewarm_size and prewarm_count:
            self.prewarm(prewarm_size, prewarm_count)

    def _try(self, size: int) -> BufferLease | None:
        """A lease now, or None when the limits say no (caller holds the condition)."""
        if self.max_regions is not None and self._active >= self.max_regions:
            return None
        if self._bytes + size > self.max_bytes:
            return None
        client = self._store._c
        got = client.staging.take(size, spill=False) if size else None
        if got is None and size:
            got = self._overflow(size)
        if got is None:
            ptr, release = 0, (lambda: None)
        else:
            ptr, _view, release = got
        self._active += 1
        self._bytes += size
        return BufferLease(self, ptr, size, release, size)

    def _overflow(self, size: int) -> tuple[int, Any, Any]:
        """A registered buffer of its own for one lease, 64-byte aligned."""
        raw = np.empty(size + 64, np.uint8)
        start = (-raw.ctypes.data) % 64
        arr = raw[start:start + size]
        engine = self._store._c.engine
        if hasattr(engine, "register_memory"):
            region = engine.register_memory(arr, publish=False)

            def release() -> None:
                engine.unregister_memory(region.addr, publish=False)
                del raw_keep[:]
        else:  # a dummy client: its own memory table
            addr = self._store._c.register_buffer(arr)

            def release() -> None:
                self._store._c.unregister_buffer(addr)
                del raw_keep[:]
        raw_keep = [raw]
        return int(arr.ctypes.data), arr, release

    def acquire(self, size: int, block: bool | None = None, timeout: float | None = None) -> BufferLease:
        """A lease of ``size`` bytes (see the module docstring).

        Raises:
            RuntimeError: closed, a size past the pool's capacity, or exhausted (no wait, or the
                wait timed out).
        """
        size = int(size)
        if size < 0 or size > min(MAX_LEASE, self.max_bytes):
            raise RuntimeError(f"lease of {size} bytes exceeds the pool's capacity "
                               f"({self.max_bytes}) or overflows")
        block = self.block_on_exhaustion if block is None else block
        timeout = self.default_timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("the buffer pool is closed")
                lease = self._try(size)
                if lease is not None:
                    return lease
                left = None if deadline is None else deadline - time.monotonic()
                if not block or (left is not None and left <= 0):
                    raise RuntimeError(f"buffer pool exhausted ({self._active} leases, "
                                       f"{self._bytes} bytes active)")
                self._cond.wait(left)

    def buffer(self, size: int, block: bool | None = None, timeout: float | None = None) -> BufferLease:
        """As :meth:`acquire`; use it as ``with pool.buffer(n) as lease:``."""
        return self.acquire(size, block, timeout)

    def _returned(self, nbytes: int) -> None:
        with self._cond:
            self._active -= 1
            self._bytes -= nbytes
            self._cond.notify_all()

    def prewarm(self, size: int, count: int) -> None:
        """Touch ``count`` leases of ``size`` once (the local buffer is mapped already)."""
        leases = [self.acquire(size, block=False) for _ in range(int(count))]
        for lease in leases:
            lease.release()

    def close(self) -> None:
        """Refuse new leases. Raises RuntimeError while leases are active."""
        with self._cond:
            if self._active:
                raise RuntimeError(f"cannot close the buffer pool: {self._active} active leases")
            self._closed = True


RegisteredBufferPool = BufferPool
