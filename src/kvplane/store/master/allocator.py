"""Per-segment space allocator: best-fit over a free list with coalescing. Pure, no I/O.

Offsets are aligned to ``ALIGN`` bytes. Two sorted lists index the free blocks, by offset (for
coalescing neighbours on free) and by (size, offset) (for best fit), so allocation and free are
O(log n) searches plus list shifts. Best fit keeps fragmentation low for the mixed-size objects
of a KV pool while exact-size reuse is immediate for the uniform KV block sizes.
"""

from __future__ import annotations

import bisect

from kvplane.common.errors import InvalidArgument

ALIGN = 64


def aligned(n: int) -> int:
    """``n`` rounded up to the allocation alignment."""
    return (n + ALIGN - 1) & ~(ALIGN - 1)


class OffsetAllocator:
    """Allocates byte ranges inside [0, capacity)."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise InvalidArgument("allocator capacity must be > 0")
        self.capacity = capacity
        self.used = 0
        self._by_off: list[tuple[int, int]] = [(0, capacity)]
        self._by_size: list[tuple[int, int]] = [(capacity, 0)]
        self._live: dict[int, int] = {}

    def _remove_free(self, off: int, size: int) -> None:
        del self._by_off[bisect.bisect_left(self._by_off, (off, size))]
        del self._by_size[bisect.bisect_left(self._by_size, (size, off))]

    def _add_free(self, off: int, size: int) -> None:
        bisect.insort(self._by_off, (off, size))
        bisect.insort(self._by_size, (size, off))

    def allocate(self, n: int) -> int | None:
        """Offset of a fresh block of ``n`` bytes, or None if no free block is big enough."""
        if n <= 0:
            raise InvalidArgument("allocation size must be > 0")
        need = aligned(n)
        i = bisect.bisect_left(self._by_size, (need, -1))
        if i == len(self._by_size):
            return None
        size, off = self._by_size[i]
        self._remove_free(off, size)
        if size > need:
            self._add_free(off + need, size - need)
        self._live[off] = need
        self.used += need
        return off

    def allocate_at(self, off: int, n: int) -> bool:
        """Take exactly ``[off, off + aligned(n))`` (re-registering an object a segment already
        holds); False when that range is not entirely free or not aligned."""
        if n <= 0 or off < 0 or off % ALIGN:
            return False
        need = aligned(n)
        i = bisect.bisect_right(self._by_off, (off, self.capacity + 1)) - 1
        if i < 0:
            return False
        boff, bsize = self._by_off[i]
        if off + need > boff + bsize:
            return False
        self._remove_free(boff, bsize)
        if off > boff:
            self._add_free(boff, off - boff)
        if boff + bsize > off + need:
            self._add_free(off + need, boff + bsize - off - need)
        self._live[off] = need
        self.used += need
        return True

    def free(self, off: int) -> None:
        """Return a block; coalesces with free neighbours.

        Raises:
            InvalidArgument: ``off`` is not a live allocation (double free).
        """
        size = self._live.pop(off, None)
        if size is None:
            raise InvalidArgument(f"offset {off} is not allocated")
        self.used -= size
        i = bisect.bisect_left(self._by_off, (off, 0))
        if i > 0:
            poff, psize = self._by_off[i - 1]
            if poff + psize == off:
                self._remove_free(poff, psize)
                off, size = poff, psize + size
                i -= 1
        if i < len(self._by_off):
            noff, nsize = self._by_off[i]
            if off + size == noff:
                self._remove_free(noff, nsize)
                size += nsize
        self._add_free(off, size)

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    def largest_free(self) -> int:
        """Size of the largest free block."""
        return self._by_size[-1][0] if self._by_size else 0

    def fragments(self) -> int:
        """Number of free blocks (1 means no fragmentation)."""
        return len(self._by_off)

    def resized(self, capacity: int) -> OffsetAllocator:
        """A copy of this allocator over ``capacity`` bytes with the same live allocations (a
        share of a segment that grows or shrinks at its end: ``kvplane.store.shard``).

        Raises:
            InvalidArgument: a live allocation would end past ``capacity``.
        """
        if any(off + size > capacity for off, size in self._live.items()):
            raise InvalidArgument(f"a live allocation ends past {capacity}")
        out = OffsetAllocator(capacity)
        for off, size in sorted(self._live.items()):
            out.allocate_at(off, size)
        return out
