"""One READ or WRITE to a same-host peer's shared memory (``read_one``/``write_one``): the
shared-memory transport copies it itself (``MappedOneIO.copy_one``), with no batch, slice or
socket, and ends it as the batch path would: the bytes, the fence before and after the copy,
the deadline, an owner that died."""

import numpy as np
import pytest

from kvplane.common.deadline import Deadline
from kvplane.transfer import TransferEngine, TransferStatus
from kvplane.transfer.fence import EPOCH_SHIFT
from kvplane.transfer.seam import Route
from kvplane.transfer.types import OpCode
from tests.support.target import pattern, spawn_target

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
MB = 1 << 20
OK = TransferStatus.COMPLETED


def _no_batch(te: TransferEngine) -> list[int]:
    """Counts the shared-memory transport's batch runs (``run``) from now on."""
    shm = te.transports["shm"]
    runs = [0]
    real = shm.run

    def counted(route, slices, deadline):
        runs[0] += 1
        return real(route, slices, deadline)

    shm.run = counted
    return runs


def test_one_item_copies_through_the_mapping_with_every_byte_right():
    a, b = TransferEngine(protocol="auto"), TransferEngine(protocol="auto")
    with a, b:
        buf = b.allocate_managed_buffer(4 * MB)
        rng = np.random.default_rng(7)
        src = rng.integers(0, 256, 4 * MB, dtype=np.uint8)
        back = np.zeros(4 * MB, np.uint8)
        a.register_memory(src)
        a.register_memory(back)
        seg = a.open_segment(b.name)
        runs = _no_batch(a)
        frames = b._server.frames
        offs = rng.integers(0, 4 * MB - 65536, 200)
        sizes = rng.integers(1, 65536, 200)
        for off, n in zip(offs.tolist(), sizes.tolist(), strict=True):
            assert a.write_one(seg, src.ctypes.data + off, buf.addr + off, n) == OK
        wrong = 0
        for off, n in zip(offs.tolist(), sizes.tolist(), strict=True):
            back[off:off + n] = 0
            assert a.read_one(seg, back.ctypes.data + off, buf.addr + off, n) == OK
            wrong += int(np.count_nonzero(back[off:off + n] != src[off:off + n]))
            wrong += int(np.count_nonzero(buf.array[off:off + n] != src[off:off + n]))
        assert wrong == 0
        assert runs == [0]  # no batch, no slice
        assert b._server.frames == frames  # and no socket


def test_a_generation_the_fence_refuses_moves_nothing():
    """The region's fence publishes epoch 5's floor: a write of an epoch-4 allocation is
    refused (the batch path reports it, failing over to TCP, whose listener refuses it too)
    and the bytes stay; the epoch-5 one lands."""
    a, b = TransferEngine(protocol="auto"), TransferEngine(protocol="auto")
    with a, b:
        buf = b.allocate_managed_buffer(MB, fenced=True)
        b.fence.set_epoch(5)
        src = np.full(4096, 0xAB, np.uint8)
        a.register_memory(src)
        seg = a.open_segment(b.name)
        at = buf.addr + 8192
        before = buf.array[8192:8192 + 4096].copy()
        old, new = (4 << EPOCH_SHIFT) | 9, (5 << EPOCH_SHIFT) | 9
        assert a.write_one(seg, src.ctypes.data, at, 4096, gen=old) != OK
        assert np.array_equal(buf.array[8192:8192 + 4096], before)
        runs = _no_batch(a)
        assert a.write_one(seg, src.ctypes.data, at, 4096, gen=new) == OK
        assert runs == [0]
        assert np.array_equal(buf.array[8192:8192 + 4096], src)


def test_deadline_before_and_after_the_copy():
    a, b = TransferEngine(protocol="auto"), TransferEngine(protocol="auto")
    with a, b:
        buf = b.allocate_managed_buffer(MB)
        src = np.full(4096, 7, np.uint8)
        a.register_memory(src)
        seg = a.open_segment(b.name)
        s = a.segment(seg)
        shm = a.transports["shm"]
        route = Route(s.desc, s.region(buf.addr, 4096), s.same_host)
        view = memoryview(src)
        # passed before: nothing moves
        gone = Deadline.after(-1.0)
        assert shm.copy_one(OpCode.WRITE, route, view, buf.addr, 1, gone) == TransferStatus.TIMEOUT
        assert not buf.array[:4096].any()

        class Lapses(Deadline):
            """Not expired at the first look, expired at every later one."""

            looks = 0

            def expired(self) -> bool:
                Lapses.looks += 1
                return Lapses.looks > 1

        late = Lapses.after(10.0)
        # a store allocation's copy that ends past its window is not COMPLETED ...
        assert shm.copy_one(OpCode.WRITE, route, view, buf.addr, 1, late) == TransferStatus.TIMEOUT
        Lapses.looks = 0
        # ... a plain one (generation 0) is
        assert shm.copy_one(OpCode.WRITE, route, view, buf.addr, 0, late) == OK


def test_an_owner_killed_is_a_failure_never_its_old_bytes():
    with spawn_target("--buf-mb", "4", "--managed") as t, TransferEngine(protocol="auto") as te:
        local = np.zeros(4096, np.uint8)
        te.register_memory(local)
        seg = te.open_segment(t.info["segment"])
        runs = _no_batch(te)
        assert te.read_one(seg, local.ctypes.data, t.info["addr"] + 4096, 4096) == OK
        assert np.array_equal(local, pattern(4096, 4096))
        assert runs == [0]
        assert te.transports["shm"].mapped()
        t.popen.kill()
        t.popen.wait(10)
        local[:] = 0
        # the transport itself refuses (its mapping still holds the dead owner's pages) ...
        s = te.segment(seg)
        route = Route(s.desc, s.region(t.info["addr"], 4096), s.same_host)
        assert te.transports["shm"].copy_one(OpCode.READ, route, memoryview(local),
                                             t.info["addr"] + 4096, 0,
                                             Deadline.after(5)) is None
        # ... and the engine ends the read FAILED, nothing copied
        assert te.read_one(seg, local.ctypes.data, t.info["addr"] + 4096, 4096,
                           timeout=5) != OK
        assert not local.any()
