"""A thread's own staging slot (``Staging.slot``): one per thread, distinct, kept while the
thread lives and given back to the buffer when it ends; None when the buffer has no room."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

from kvplane.store.client.staging import SLOT, Staging

pytestmark = pytest.mark.timeout(30)


class _Buffer:
    def __init__(self, n: int) -> None:
        self.array = np.zeros(n, np.uint8)
        self.addr = self.array.ctypes.data


class _Engine:
    """What ``Staging`` asks of the engine for its shared buffer."""

    def allocate_managed_buffer(self, n: int) -> _Buffer:
        return _Buffer(n)


def _in_thread(fn):  # type: ignore[no-untyped-def]
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(10)
    assert not t.is_alive()
    return out[0]


def test_a_thread_keeps_one_slot_and_threads_get_distinct_ones():
    st = Staging(_Engine(), 8 * SLOT)  # type: ignore[arg-type]
    mine = st.slot()
    assert mine is not None and st.slot() is mine  # kept, not carved again
    assert len(mine.mem) == len(mine.array) == SLOT
    held = threading.Event()
    done = threading.Event()
    theirs = []

    def other() -> None:
        theirs.append(st.slot())
        held.set()
        done.wait(10)

    t = threading.Thread(target=other)
    t.start()
    assert held.wait(10)
    try:
        other_slot = theirs[0]
        assert other_slot is not None
        lo, hi = sorted([mine.addr, other_slot.addr])
        assert hi - lo >= SLOT  # no overlap
        mine.mem[:] = b"\x01" * SLOT
        assert not np.any(other_slot.array)  # writing one leaves the other alone
    finally:
        done.set()
        t.join(10)


def test_a_finished_threads_slot_goes_back_to_the_buffer():
    st = Staging(_Engine(), 8 * SLOT)  # room for two slots  # type: ignore[arg-type]
    for _ in range(10):  # ten threads one after another: each finds the last one's room
        assert _in_thread(lambda: st.slot() is not None)
        gc.collect()
    assert st.slot() is not None and _in_thread(lambda: st.slot() is not None)


def test_no_room_means_no_slot():
    st = Staging(_Engine(), 4 * SLOT - 1)  # type: ignore[arg-type]
    assert st.slot() is None
    assert Staging(_Engine(), 0).slot() is None  # type: ignore[arg-type]


def test_slots_take_at_most_a_quarter_of_the_buffer():
    st = Staging(_Engine(), 8 * SLOT)  # type: ignore[arg-type]
    gate = threading.Event()
    carved = threading.Barrier(4)
    got: list[object] = []

    def hold() -> None:
        got.append(st.slot())
        carved.wait(10)
        gate.wait(10)

    threads = [threading.Thread(target=hold) for _ in range(3)]
    for t in threads:
        t.start()
    carved.wait(10)
    try:
        assert sum(s is not None for s in got) == 2  # the third thread writes the usual way
        with st.block(6 * SLOT) as (addr, view):  # the rest is there for blocks
            assert len(view) == 6 * SLOT
    finally:
        gate.set()
        for t in threads:
            t.join(10)
