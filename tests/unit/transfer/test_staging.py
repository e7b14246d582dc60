"""Pure pieces of device staging: the chunk plan and the staging ring's slot accounting."""

import numpy as np
import pytest

from kvplane.common.deadline import Deadline
from kvplane.common.errors import DeviceFailed, InvalidArgument, Timeout
from kvplane.transfer.device import HostBuffer
from kvplane.transfer.staging import Chunk, StagingRing, plan_chunks

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(("length", "chunk", "expect"), [
    (1000, 4096, [Chunk(0, 1000)]),                       # below one chunk
    (4096, 4096, [Chunk(0, 4096)]),                       # exactly one
    (8192, 4096, [Chunk(0, 4096), Chunk(4096, 4096)]),    # a multiple
    (10000, 4096, [Chunk(0, 4096), Chunk(4096, 4096), Chunk(8192, 1808)]),  # not a multiple
    (1, 1, [Chunk(0, 1)]),
])
def test_plan_chunks(length, chunk, expect):
    plan = plan_chunks(length, chunk)
    assert plan == expect
    assert sum(c.length for c in plan) == length  # covers every byte once, in order
    assert all(b.offset == a.offset + a.length for a, b in zip(plan, plan[1:]))


@pytest.mark.parametrize(("length", "chunk"), [(0, 4096), (-1, 4096), (10, 0)])
def test_plan_chunks_refuses_empty(length, chunk):
    with pytest.raises(InvalidArgument):
        plan_chunks(length, chunk)


def ring(count=3, size=64):
    arr = np.zeros(count * size, np.uint8)
    return StagingRing(HostBuffer(int(arr.ctypes.data), arr.nbytes, arr), size, count), arr


def test_slots_are_disjoint_views_of_the_buffer():
    r, arr = ring()
    slots = r.take(3, Deadline.after(1))
    assert sorted(s.addr for s in slots) == [arr.ctypes.data + i * 64 for i in range(3)]
    for i, s in enumerate(sorted(slots)):
        s.view[:] = bytes([i + 1]) * 64
    assert list(arr[::64]) == [1, 2, 3]


def test_take_gives_what_is_free_and_blocks_only_for_the_first():
    r, _ = ring(count=3)
    a = r.take(2, Deadline.after(1))
    b = r.take(2, Deadline.after(1))  # one left: it gets one, without waiting for a second
    assert (len(a), len(b), r.free) == (2, 1, 0)
    with pytest.raises(Timeout):
        r.take(1, Deadline.after(0.05))
    r.give(a)
    assert r.free == 2


class _Fence:
    def __init__(self):
        self.state = "running"

    def wait(self, timeout):
        if self.state == "running":
            raise Timeout("not yet")
        if self.state == "failed":
            raise DeviceFailed("boom")


@pytest.mark.parametrize("ending", ["done", "failed"])
def test_held_back_slot_returns_once_its_copy_ends(ending):
    r, _ = ring(count=2)
    slot, other = r.take(2, Deadline.after(1))
    fence = _Fence()
    r.hold_back(slot, fence)
    r.give([other])
    assert (r.free, r.lost) == (1, 1)  # a late copy could still write it: not handed out
    fence.state = ending
    assert (r.free, r.lost) == (2, 0)
    assert len(r.take(2, Deadline.after(1))) == 2


def test_ring_refuses_a_buffer_too_small():
    arr = np.zeros(100, np.uint8)
    with pytest.raises(InvalidArgument):
        StagingRing(HostBuffer(int(arr.ctypes.data), 100, arr), 64, 2)


@pytest.mark.timeout(60)  # importing torch on a busy machine
def test_buffer_of_a_device_tensor_takes_no_host_view():
    """A tensor on a device other than the CPU ("meta" here: no GPU needed) is device memory."""
    torch = pytest.importorskip("torch")
    from kvplane.transfer.memory import buffer_of
    t = torch.empty(16, dtype=torch.float32, device="meta")
    addr, n, keep, device = buffer_of(t)
    assert (addr, n, keep, device) == (t.data_ptr(), 64, t, "meta")
    with pytest.raises(InvalidArgument, match="contiguous"):
        buffer_of(torch.empty(4, 4, device="meta").t())
    with pytest.raises(InvalidArgument):
        buffer_of(t, device="cuda:0")  # a tensor knows its device
    cpu = torch.zeros(4)
    assert buffer_of(cpu)[3] == ""
    assert buffer_of((cpu.data_ptr(), 16), device="standin:0")[3] == "standin:0"


@pytest.mark.timeout(60)  # importing torch on a busy machine
def test_cuda_ipc_advert_round_trip_and_refusals():
    """The parts of the cudaipc transport that need no GPU: its advert codec, and a clear
    refusal to load where there is no CUDA device (the copies themselves: tests/gpu)."""
    from kvplane.transfer import TransferEngine
    from kvplane.transfer.transports.cuda_ipc import _ENC, Export, decode_advert
    exp = Export(0, b"h" * 64, 1 << 20, 0, b"r", 8, b"e", True, 256, 4096)
    assert decode_advert(_ENC.encode({0x7F00: exp})) == {0x7F00: exp}
    with pytest.raises(InvalidArgument, match="CUDA IPC advert"):
        decode_advert(b"\x93garbage")
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the transport loads")
    with pytest.raises(InvalidArgument, match="needs a CUDA device"):
        TransferEngine(transports=("tcp", "local", "cudaipc"))
