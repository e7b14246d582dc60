"""Per-segment space allocator: best-fit over a free list with coalescing. Pure, no I/O.

Offsets are aligned to ``ALIGN`` bytes. Two sorted lists index the free blocks, by offset (for
coalescing neighbours on free) and by (size, offset) (for best fit), so allocation and free are
O(log n) searches plus list shifts. Best fit keeps fragmentation low for the mixed-size objects
of a KV pool while exact-size reuse is immediate for the uniform KV block sizes.

The allocator keeps nothing per live allocation: whoever frees a block says its size (the
master's object table and task records hold it anyway), so a pool of millions of objects costs
no memory here beyond its free blocks. A free that overlaps free space (a double free, or a
wrong size) is refused.
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
        self.used += need
        return True

    def free(self, off: int, n: int) -> None:
        """Return the block of ``n`` bytes (as allocated) at ``off``; coalesces with free
        neighbours.

        Raises:
            InvalidArgument: the block overlaps free space or the segment's end (a double
                free, or not the size it was allocated with).
        """
        size = aligned(n)
        i = bisect.bisect_left(self._by_off, (off, 0))
        prev = self._by_off[i - 1] if i > 0 else None
        after = self._by_off[i] if i < len(self._by_off) else None
        if n <= 0 or off < 0 or off + size > self.capacity or off % ALIGN or \
                (prev is not None and prev[0] + prev[1] > off) or \
                (after is not None and after[0] < off + size):
            raise InvalidArgument(f"[{off}, {off + size}) is not an allocated block")
        self.used -= size
        if prev is not None and prev[0] + prev[1] == off:
            self._remove_free(*prev)
            off, size = prev[0], prev[1] + size
        if after is not None and off + size == after[0]:
            self._remove_free(*after)
            size += after[1]
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
