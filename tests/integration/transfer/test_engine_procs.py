"""Two and three real processes on 127.0.0.1 moving bytes through every transport."""

import asyncio

import numpy as np
import pytest

from kvplane.common.errors import AddressNotRegistered, InvalidArgument
from kvplane.transfer import OpCode, TransferEngine, TransferRequest, TransferStatus
from kvplane.transfer.transports import Route
from tests.support.target import pattern, spawn_target

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
MB = 1 << 20


@pytest.fixture
def target():
    with spawn_target("--buf-mb", "16") as p:
        yield p


@pytest.fixture
def engine():
    with TransferEngine(protocol="tcp") as te:
        yield te


def remote_sum(proc, off, n):
    return proc.ask(f"sum {off} {n}")["sum"]


def test_write_then_read_over_tcp(target, engine):
    local = np.random.randint(0, 256, 4 * MB, dtype=np.uint8)
    engine.register_memory(local)
    seg = engine.open_segment(target.info["segment"])
    raddr = target.info["addr"]
    engine.write(seg, local.ctypes.data, raddr + MB, 4 * MB)
    assert remote_sum(target, MB, 4 * MB) == int(local.sum(dtype=np.uint64))
    back = np.zeros(4 * MB, np.uint8)
    engine.register_memory(back)
    engine.read(seg, back.ctypes.data, raddr + MB, 4 * MB)
    assert np.array_equal(back, local)
    # untouched neighbours keep the target's pattern
    engine.read(seg, back.ctypes.data, raddr, 1000)
    assert np.array_equal(back[:1000], pattern(1000))


def test_batch_of_many_small_requests(target, engine):
    local = np.zeros(32 * 4096, np.uint8)
    engine.register_memory(local)
    seg = engine.open_segment(target.info["segment"])
    raddr = target.info["addr"]
    reqs = [TransferRequest(OpCode.READ, local.ctypes.data + i * 4096, seg,
                            raddr + (31 - i) * 4096, 4096) for i in range(32)]
    assert engine.transfer(reqs) == [TransferStatus.COMPLETED] * 32
    for i in range(32):
        assert np.array_equal(local[i * 4096:(i + 1) * 4096], pattern(4096, (31 - i) * 4096))


def test_async_batch_polling_and_free(target, engine):
    local = np.zeros(8 * MB, np.uint8)
    engine.register_memory(local)
    seg = engine.open_segment(target.info["segment"])
    bid = engine.allocate_batch(8)
    reqs = [TransferRequest(OpCode.READ, local.ctypes.data + i * MB, seg,
                            target.info["addr"] + i * MB, MB) for i in range(8)]
    engine.submit(bid, reqs[:4])
    engine.submit(bid, reqs[4:])
    with pytest.raises(InvalidArgument):
        engine.submit(bid, reqs[:1])  # over capacity
    statuses = engine.wait(bid, timeout=20)
    assert statuses == [TransferStatus.COMPLETED] * 8
    assert engine.status(bid, 3) == (TransferStatus.COMPLETED, MB)
    engine.free_batch(bid)
    assert np.array_equal(local, pattern(8 * MB))


def test_asyncio_form(target, engine):
    local = np.zeros(MB, np.uint8)
    engine.register_memory(local)
    seg = engine.open_segment(target.info["segment"])
    req = TransferRequest(OpCode.READ, local.ctypes.data, seg, target.info["addr"], MB)

    async def go():
        return await engine.transfer_async([req], timeout=10)

    assert asyncio.run(go()) == [TransferStatus.COMPLETED]
    assert np.array_equal(local, pattern(MB))


def test_bad_ranges_are_clear_errors_and_touch_nothing(target, engine):
    local = np.zeros(MB, np.uint8)
    engine.register_memory(local)
    seg = engine.open_segment(target.info["segment"])
    raddr, size = target.info["addr"], target.info["size"]
    with pytest.raises(AddressNotRegistered):
        engine.read(seg, local.ctypes.data, raddr + size - 10, 100)
    with pytest.raises(AddressNotRegistered):
        engine.read(seg, local.ctypes.data + MB - 10, raddr, 100)  # local overrun
    with pytest.raises(InvalidArgument):
        engine.transfer([TransferRequest(OpCode.READ, local.ctypes.data, seg, raddr, 0)], check=True)
    assert not local.any()
    assert remote_sum(target, 0, size) == int(pattern(size).sum(dtype=np.uint64))


def test_three_processes(engine):
    with spawn_target("--buf-mb", "4") as t1, spawn_target("--buf-mb", "4") as t2:
        local = np.zeros(2 * MB, np.uint8)
        engine.register_memory(local)
        s1, s2 = engine.open_segment(t1.info["segment"]), engine.open_segment(t2.info["segment"])
        reqs = [TransferRequest(OpCode.READ, local.ctypes.data, s1, t1.info["addr"], MB),
                TransferRequest(OpCode.READ, local.ctypes.data + MB, s2, t2.info["addr"] + MB, MB)]
        assert engine.transfer(reqs) == [TransferStatus.COMPLETED] * 2
        assert np.array_equal(local[:MB], pattern(MB))
        assert np.array_equal(local[MB:], pattern(MB, MB))


def test_shm_transport_for_managed_buffers():
    with spawn_target("--buf-mb", "8", "--managed") as t, TransferEngine(protocol="auto") as te:
        local = np.random.randint(0, 256, 8 * MB, dtype=np.uint8)
        te.register_memory(local)
        seg = te.open_segment(t.info["segment"])
        route_kind = te.segment(seg).region(t.info["addr"], 1).kind
        assert route_kind == "shm"
        te.write(seg, local.ctypes.data, t.info["addr"], 8 * MB)
        assert remote_sum(t, 0, 8 * MB) == int(local.sum(dtype=np.uint64))
        # forcing tcp still works and gives the same bytes back
        back = np.zeros(8 * MB, np.uint8)
        te.register_memory(back)
        te.transfer([TransferRequest(OpCode.READ, back.ctypes.data, seg, t.info["addr"], 8 * MB,
                                     transport="tcp")], check=True)
        assert np.array_equal(back, local)


def test_same_host_plain_memory_uses_cross_memory_attach(target):
    with TransferEngine(protocol="auto") as te:
        local = np.zeros(2 * MB, np.uint8)
        te.register_memory(local)
        seg = te.open_segment(target.info["segment"])
        s = te.segment(seg)
        route = Route(s.desc, s.region(target.info["addr"], MB), s.same_host)
        if not te.transports["shm"].can_reach(route):
            pytest.skip("kernel refuses process_vm_readv here; auto falls back to tcp")
        te.transfer([TransferRequest(OpCode.READ, local.ctypes.data, seg, target.info["addr"] + 5,
                                     2 * MB, transport="shm")], check=True)
        assert np.array_equal(local, pattern(2 * MB, 5))
