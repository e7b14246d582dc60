import random

import pytest

from kvplane.common.errors import InvalidArgument
from kvplane.store.master.allocator import ALIGN, OffsetAllocator, aligned


def test_alloc_free_coalesce():
    a = OffsetAllocator(1024 * ALIGN)
    x = a.allocate(100)
    y = a.allocate(ALIGN)
    z = a.allocate(10 * ALIGN)
    assert (x, y, z) == (0, aligned(100), aligned(100) + ALIGN)
    assert a.used == aligned(100) + 11 * ALIGN
    a.free(y, ALIGN)
    assert a.allocate(ALIGN) == y  # best fit reuses the exact hole
    a.free(x, 100)
    a.free(y, ALIGN)
    a.free(z, 10 * ALIGN)
    assert a.used == 0 and a.fragments() == 1 and a.largest_free() == a.capacity
    with pytest.raises(InvalidArgument):
        a.free(x, 100)  # a double free


def test_exhaustion_and_best_fit():
    a = OffsetAllocator(4 * ALIGN)
    offs = [a.allocate(ALIGN) for _ in range(4)]
    assert a.allocate(1) is None
    a.free(offs[1], ALIGN)
    a.free(offs[3], ALIGN)
    assert a.allocate(2 * ALIGN) is None  # 2 free blocks, not adjacent
    assert a.allocate(ALIGN) == offs[1]


def test_random_workload_never_overlaps():
    rng = random.Random(7)
    a = OffsetAllocator(1 << 20)
    live = {}
    for _ in range(5000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            a.free(off, live.pop(off))
        else:
            n = rng.choice([64, 4096, 5000, 65536])
            off = a.allocate(n)
            if off is not None:
                live[off] = aligned(n)
        spans = sorted(live.items())
        for (o1, s1), (o2, _) in zip(spans, spans[1:]):
            assert o1 + s1 <= o2
        assert a.used == sum(live.values())
    for off, n in list(live.items()):
        a.free(off, n)
    assert a.fragments() == 1
