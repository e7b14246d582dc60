"""Per-segment space allocator: best-fit over a free list with coalescing. Pure, no I/O.

Offsets are aligned to ``ALIGN`` bytes. Two sorted lists index the free blocks, by offset (for
coalescing neighbours on free) and by (size, offset) (for best fit), so allocation and free are
O(log n) searches plus list shifts. Best fit keeps fragmentation low for the mixed-size objects
of a KV pool while exact-size reuse is immediate for the uniform KV block sizes.

The allocator keeps nothing per live allocation: whoever frees a block says its size (the
master's object table and task records hold it anyway), so a pool of millions of objects costs
no memory here beyond its free blocks. A free that overlaps free space (a double free, or a
wrong size) is refused.

The allocators of one pool may share a :class:`Usage`: the bytes mounted and allocated over all
of them, kept as each allocation and free happens, so that the master reads the pool's fill
(its watermarks, a spare's headroom) in O(1) whatever the number of segments.
"""

from __future__ import annotations

import bisect

from kvplane.common.errors import InvalidArgument

ALIGN = 64


def aligned(n: int) -> int:
    """``n`` rounded up to the allocation alignment."""
    return (n + ALIGN - 1) & ~(ALIGN - 1)


class Usage:
    """Bytes mounted (``capacity``) and allocated (``used``) over the allocators attached."""

    def __init__(self) -> None:
        self.capacity = 0
        self.used = 0

    def attach(self, alloc: OffsetAllocator) -> None:
        """Count ``alloc`` (attached to no other usage) from now on."""
        if alloc.usage is not None:
            raise InvalidArgument("the allocator is counted by another usage already")
        alloc.usage = self
        self.capacity += alloc.capacity
        self.used += alloc.used

    def detach(self, alloc: OffsetAllocator) -> None:
        """Stop counting ``alloc`` (attached to this usage)."""
        if alloc.usage is not self:
            raise InvalidArgument("the allocator is not counted by this usage")
        alloc.usage = None
        self.capacity -= alloc.capacity
        self.used -= alloc.used

    def ratio(self) -> float:
        """Allocated over mounted (0.0 when nothing is mounted)."""
        return self.used / self.capacity if self.capacity else 0.0


class OffsetAllocator:
    """Allocates byte ranges inside [0, capacity)."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise InvalidArgument("allocator capacity must be > 0")
        self.capacity = capacity
        self.used = 0
        self.usage: Usage | None = None  # the pool's totals, kept with ``used`` (``Usage``)
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
        if self.usage is not None:
            self.usage.used += need
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
        if self.usage is not None:
            self.usage.used += need
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
        if self.usage is not None:
            self.usage.used -= size
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

    def free_tail(self) -> int:
        """Where the free space that reaches the end begins (``capacity``: none does)."""
        if self._by_off and sum(self._by_off[-1]) == self.capacity:
            return self._by_off[-1][0]
        return self.capacity

    def resized(self, capacity: int) -> OffsetAllocator:
        """A copy of this allocator over ``capacity`` bytes with the same allocations (a share
        of a segment that grows or shrinks at its end: ``kvplane.store.shard``), counted by no
        usage (``ObjectTable.resize_segment`` moves the count).

        Raises:
            InvalidArgument: an allocation would end past ``capacity``.
        """
        tail = self.free_tail()
        if capacity < tail or capacity <= 0:
            raise InvalidArgument(f"an allocation ends past {capacity}")
        blocks = self._by_off[:-1] if tail < self.capacity else list(self._by_off)
        if capacity > tail:
            blocks.append((tail, capacity - tail))
        out = OffsetAllocator(capacity)
        out._by_off = blocks
        out._by_size = sorted((n, off) for off, n in blocks)
        out.used = capacity - sum(n for _, n in blocks)
        return out
