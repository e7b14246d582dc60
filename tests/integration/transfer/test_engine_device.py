"""Device memory in the transfer engine, on the stand-in device (tests.support.standin_device):
memory the host cannot address (non-canonical addresses, no view in the engine) that moves
only through its copier. The initiator engine runs here (its device is the test's), the target
is a real process (tests.support.target) reached over TCP or same-host shared memory.

Covered: both directions over tcp and shm, sizes below, equal to and not a multiple of the
chunk, bytes checksummed; the pipeline's order from the device's event log (a WRITE's next
copy starts before this chunk's send ends; a READ's next chunk is received while this one
copies, proven by a copy that is held until then); a copy failure at chunk k (FAILED, nothing
after it sent); a stalled copy (TIMEOUT within the deadline, its slot held back until the copy
ends); the target's own device region served through its listener's staging, its failures
seen by the initiator.
"""

import hashlib
import threading
import time

import numpy as np
import pytest

from kvplane.common.errors import InvalidArgument
from kvplane.common.procs import wait_until
from kvplane.transfer import OpCode, TransferEngine, TransferRequest, TransferStatus
from tests.support.standin_device import StandinDevice
from tests.support.target import pattern, spawn_target

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
CHUNK = 64 << 10
SIZES = [1000, CHUNK, 3 * CHUNK + 123]
OK = TransferStatus.COMPLETED


@pytest.fixture(scope="module")
def plain_target():
    with spawn_target("--buf-mb", "4") as p:
        yield p


@pytest.fixture(scope="module")
def shm_target():
    with spawn_target("--buf-mb", "4", "--managed") as p:
        yield p


@pytest.fixture(scope="module")
def dev_target():
    with spawn_target("--buf-mb", "1", "--standin-mb", "2", "--device-chunk", str(CHUNK)) as p:
        yield p


@pytest.fixture
def dev():
    d = StandinDevice("standin:0")
    yield d
    d.close()


@pytest.fixture
def tdev():
    d = StandinDevice("standin:0", threaded=True)
    yield d
    d.close()


def engine(protocol="tcp", **kw):
    return TransferEngine(protocol=protocol, device_chunk=CHUNK, device_slots=4, **kw)


def dev_region(te, d, n):
    addr = d.alloc(n)
    te.register_memory((addr, n), device=d.name)
    return addr


def rsum(proc, off, n, cmd="sum"):
    return proc.ask(f"{cmd} {off} {n}")["sum"]


def one(te, op, local, seg, remote, n, timeout=10.0):
    bid = te.allocate_batch(1)
    te.submit(bid, [TransferRequest(op, local, seg, remote, n)], timeout)
    st = te.wait(bid, timeout + 5)[0]
    err = te.errors(bid)[0]
    te.free_batch(bid)
    return st, err


def test_a_device_region_has_no_host_view(dev):
    with engine() as te:
        addr = dev.alloc(CHUNK)
        region = te.register_memory((addr, CHUNK), device=dev.name)
        assert (region.kind, region.view, region.device) == ("dev", None, "standin:0")
        with pytest.raises(InvalidArgument, match="dev region"):
            te.memory.view(addr, 16)
        assert [r.device for r in te.describe().regions] == ["standin:0"]
        with pytest.raises(InvalidArgument):
            te.register_memory(np.zeros(8, np.uint8), device="standin:0")  # a host buffer
        raw = dev.alloc(100)
        assert te.register_memory(raw, 100, device=dev.name).kind == "dev"  # int address form


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("proto", ["tcp", "shm"])
def test_device_to_host_and_back(proto, n, dev, plain_target, shm_target):
    target = plain_target if proto == "tcp" else shm_target
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    with engine(proto) as te:
        src, back = dev_region(te, dev, n), dev_region(te, dev, n)
        dev.write(src, data)
        seg = te.open_segment(target.info["segment"])
        raddr = target.info["addr"] + 4096
        assert one(te, OpCode.WRITE, src, seg, raddr, n) == (OK, "")
        assert rsum(target, 4096, n) == int(np.frombuffer(data, np.uint8).sum(dtype=np.uint64))
        assert one(te, OpCode.READ, back, seg, raddr, n) == (OK, "")
        assert dev.digest(back, n) == hashlib.sha256(data).hexdigest()
        chunks = -(-n // CHUNK)
        assert dev.batches == {"to_host": chunks, "to_device": chunks}  # all through the copier
        lane = te._lanes.lane(dev.name)
        assert (lane.ring.free, lane.ring.lost) == (4, 0)
        staging = lane.ring.buffer.addr
        assert te.memory.find(staging, 4 * CHUNK).view is not None  # registered for transports
        assert staging not in [r.addr for r in te.describe().regions]  # but not published


def logged(te, d, name="tcp"):
    """Log every chunk the engine's transport moves in ``d``'s event log."""
    t = te.transports[name]
    run = t.run

    def run_logged(route, slices, deadline):
        for s in slices:
            d.note("move_start", s.op.name, s.remote)
        run(route, slices, deadline)
        for s in slices:
            d.note("move_done", s.op.name, s.remote)
    t.run = run_logged


def test_write_copies_the_next_chunk_before_this_one_is_sent(tdev, plain_target):
    n = 4 * CHUNK
    with engine() as te:
        src = dev_region(te, tdev, n)
        tdev.write(src, bytes(range(256)) * (n // 256))
        seg = te.open_segment(plain_target.info["segment"])
        raddr = plain_target.info["addr"] + (3 << 20)  # a range no other test reads
        logged(te, tdev)
        assert one(te, OpCode.WRITE, src, seg, raddr, n) == (OK, "")
    log = tdev.log
    for k in range(3):
        sent = log.index(("move_done", "WRITE", raddr + k * CHUNK))
        assert log.index(("enqueue", "to_host", k + 1)) < sent, log
        assert log.index(("done", "to_host", k)) < log.index(("move_start", "WRITE", raddr + k * CHUNK))


def test_read_receives_the_next_chunk_while_this_one_copies(tdev, plain_target):
    """The copy of chunk 0 to the device is held until chunk 1 has been received: a READ that
    waited for each copy before receiving the next chunk would never finish."""
    n = 3 * CHUNK
    raddr = plain_target.info["addr"] + (2 << 20) + 100  # a range no test writes
    gate = tdev.gates[("to_device", 0)] = threading.Event()
    with engine() as te:
        dst = dev_region(te, tdev, n)
        seg = te.open_segment(plain_target.info["segment"])
        logged(te, tdev)
        t = te.transports["tcp"]
        run = t.run

        def open_gate_after_chunk_1(route, slices, deadline):
            run(route, slices, deadline)
            if any(s.remote == raddr + CHUNK for s in slices):
                gate.set()
        t.run = open_gate_after_chunk_1
        assert one(te, OpCode.READ, dst, seg, raddr, n, timeout=5.0) == (OK, "")
        assert tdev.read(dst, n) == pattern(n, (2 << 20) + 100).tobytes()
    log = tdev.log
    assert log.index(("move_done", "READ", raddr + CHUNK)) < log.index(("run", "to_device", 0))


@pytest.mark.parametrize("op", [OpCode.WRITE, OpCode.READ])
@pytest.mark.parametrize("refuse", [False, True])
def test_a_failed_copy_at_chunk_k_fails_the_transfer(op, refuse, dev, plain_target):
    n, k = 4 * CHUNK + 10, 2
    kind = "to_host" if op == OpCode.WRITE else "to_device"
    with engine() as te:
        local = dev_region(te, dev, n)
        dev.write(local, b"\x07" * n)
        seg = te.open_segment(plain_target.info["segment"])
        off = (512 + 320 * refuse) * 1024  # a range of its own (the target is shared)
        raddr = plain_target.info["addr"] + off
        dev.skip[kind], dev.refuse = k, refuse
        setattr(dev, f"fail_{kind}", 1)
        st, err = one(te, op, local, seg, raddr, n)
        assert st == TransferStatus.FAILED and "device copy failed" in err and "stand-in" in err
        if op == OpCode.WRITE:  # chunks k and later never left: the target keeps its bytes
            rest = n - k * CHUNK
            assert rsum(plain_target, off + k * CHUNK, rest) == int(
                pattern(rest, off + k * CHUNK).sum(dtype=np.uint64))
        lane = te._lanes.lane(dev.name)
        assert (lane.ring.free, lane.ring.lost) == (4, 0)
        assert one(te, op, local, seg, raddr, n) == (OK, "")  # the next transfer is unaffected


@pytest.mark.parametrize("op", [OpCode.WRITE, OpCode.READ])
def test_a_stalled_copy_ends_at_the_deadline(op, tdev, plain_target):
    n = 2 * CHUNK
    with engine() as te:
        local = dev_region(te, tdev, n)
        seg = te.open_segment(plain_target.info["segment"])
        tdev.stall = threading.Event()
        t0 = time.monotonic()
        st, err = one(te, op, local, seg, plain_target.info["addr"], n, timeout=1.0)
        took = time.monotonic() - t0
        assert st == TransferStatus.TIMEOUT and "did not finish before the deadline" in err
        assert took < 3.0
        lane = te._lanes.lane(tdev.name)
        assert lane.ring.lost >= 1  # a late copy could still land in it: held back
        tdev.stall.set()
        wait_until(lambda: not lane.ring.lost, 5, "the held-back staging slot")
        assert (lane.ring.free, lane.ring.lost) == (4, 0)
        tdev.stall = None
        assert one(te, op, local, seg, plain_target.info["addr"], n) == (OK, "")


def test_items_paths_take_device_memory(dev, plain_target):
    n = CHUNK + 5
    with engine() as te:
        a, b = dev_region(te, dev, n), dev_region(te, dev, n)
        dev.write(a, b"\x5a" * n)
        seg = te.open_segment(plain_target.info["segment"])
        raddr = plain_target.info["addr"] + 2 * CHUNK
        assert te.write_many([(seg, a, raddr, n, 0)]) == [OK]
        assert te.read_one(seg, b, raddr, n) == OK
        assert dev.read(b, n) == b"\x5a" * n


@pytest.mark.parametrize("n", [1000, 2 * CHUNK + 77])
@pytest.mark.parametrize("proto", ["tcp", "shm"])
def test_the_targets_device_region_is_staged_by_its_listener(proto, n, dev_target):
    data = np.random.default_rng(n + 1).integers(0, 256, n, dtype=np.uint8)
    with engine(proto) as te:
        buf = np.zeros(n, np.uint8)
        te.register_memory(buf)
        seg = te.open_segment(dev_target.info["segment"])
        off = 8192 + (1 << 20) * (proto == "shm") + (256 << 10) * (n > 1000)  # its own range
        daddr = dev_target.info["dev_addr"] + off
        assert one(te, OpCode.READ, int(buf.ctypes.data), seg, daddr, n) == (OK, "")
        assert np.array_equal(buf, pattern(n, off))
        assert te.read_many([(seg, int(buf.ctypes.data), daddr, n, 0)]) == [OK]
        buf[:] = data
        assert one(te, OpCode.WRITE, int(buf.ctypes.data), seg, daddr, n) == (OK, "")
        assert rsum(dev_target, off, n, "dsum") == int(data.sum(dtype=np.uint64))
        dev_target.ask("dfail to_host 0")
        st, err = one(te, OpCode.READ, int(buf.ctypes.data), seg, daddr, n)
        assert st == TransferStatus.FAILED and "stand-in device: copy failed" in err
        dev_target.ask("dfail to_device 0")
        st, err = one(te, OpCode.WRITE, int(buf.ctypes.data), seg, daddr + n, n)
        assert st == TransferStatus.FAILED and "stand-in device: copy failed" in err
        assert one(te, OpCode.WRITE, int(buf.ctypes.data), seg, daddr, n) == (OK, "")


@pytest.mark.parametrize("retries", [0, 2])
def test_a_copy_failing_mid_read_on_the_target_drops_the_connection(retries, dev_target):
    """The target's second chunk fails after the answer began: only a dropped connection can
    say so. Without retries the READ is FAILED; with them it is re-read whole, right bytes."""
    n, off = 3 * CHUNK, (1 << 20) + (768 << 10)  # one frame, three target chunks; its own range
    with engine(retries=retries) as te:
        buf = np.zeros(n, np.uint8)
        te.register_memory(buf)
        seg = te.open_segment(dev_target.info["segment"])
        dev_target.ask("dfail to_host 1")
        st, _ = one(te, OpCode.READ, int(buf.ctypes.data), seg, dev_target.info["dev_addr"] + off, n)
        assert dev_target.ask("dinfo")["fail_to_host"] == 0  # the failure did happen
        if retries:
            assert st == OK and np.array_equal(buf, pattern(n, off))
        else:
            assert st == TransferStatus.FAILED


def test_the_target_acks_a_write_only_after_its_device_copies():
    """A target whose device stalls never acknowledges the WRITE: the initiator times out
    instead of being told the bytes are in device memory; once the device runs, they are."""
    with spawn_target("--buf-mb", "1", "--standin-mb", "1", "--device-chunk", str(CHUNK),
                      "--standin-threaded") as target, engine() as te:
        n = CHUNK + 3  # two chunks: both fit the two slots, so only the final wait holds the ack
        buf = np.full(n, 9, np.uint8)
        te.register_memory(buf)
        seg = te.open_segment(target.info["segment"])
        daddr = target.info["dev_addr"]
        target.ask("dstall on")
        t0 = time.monotonic()
        st, _ = one(te, OpCode.WRITE, int(buf.ctypes.data), seg, daddr, n, timeout=1.0)
        assert st == TransferStatus.TIMEOUT and time.monotonic() - t0 < 3.0
        target.ask("dstall off")
        buf[:] = 4
        assert one(te, OpCode.WRITE, int(buf.ctypes.data), seg, daddr, n) == (OK, "")
        assert rsum(target, 0, n, "dsum") == 4 * n


def test_device_to_device_stages_on_both_sides(dev, dev_target):
    n = 3 * CHUNK + 1
    data = np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8).tobytes()
    with engine() as te:
        src, back = dev_region(te, dev, n), dev_region(te, dev, n)
        dev.write(src, data)
        seg = te.open_segment(dev_target.info["segment"])
        daddr = dev_target.info["dev_addr"] + CHUNK
        assert one(te, OpCode.WRITE, src, seg, daddr, n) == (OK, "")
        assert rsum(dev_target, CHUNK, n, "dsum") == int(np.frombuffer(data, np.uint8).sum(
            dtype=np.uint64))
        assert one(te, OpCode.READ, back, seg, daddr, n) == (OK, "")
        assert dev.read(back, n) == data


@pytest.mark.parametrize("op", [OpCode.WRITE, OpCode.READ])
def test_a_transport_that_moves_device_memory_gets_it_unstaged(op, dev):
    """A fabric declaring ``device_kinds`` (as NIXL does for cuda) gets DeviceSlices: no
    staging copy runs; when it fails, its TCP fallback moves the request through staging."""
    import uuid

    from tests.support.standin_fabric import NAME
    n = 2 * CHUNK + 9
    meta = f"memory://fabric-{uuid.uuid4().hex}"
    with engine("auto", transports=("tcp", "local", NAME), metadata=meta) as a, \
            engine("tcp", metadata=meta) as b:
        local = dev_region(a, dev, n)
        host = np.zeros(n, np.uint8)
        b.register_memory(host)
        seg = a.open_segment(b.name)
        fabric = a.transports[NAME]
        data = np.random.default_rng(3).integers(0, 256, n, dtype=np.uint8).tobytes()
        if op == OpCode.WRITE:
            dev.write(local, data)
        else:
            host[:] = np.frombuffer(data, np.uint8)
        assert one(a, op, local, seg, int(host.ctypes.data), n) == (OK, "")
        assert fabric.seen == [("standin:0", local)]  # the device range itself, no view
        assert host.tobytes() == data if op == OpCode.WRITE else dev.read(local, n) == data
        assert dev.batches == {"to_host": 0, "to_device": 0} and a._lanes.staging() == []
        fabric.fail = True
        back = dev_region(a, dev, n)
        if op == OpCode.WRITE:
            host[:] = 0
            assert one(a, op, local, seg, int(host.ctypes.data), n) == (OK, "")
            assert host.tobytes() == data
        else:
            assert one(a, op, back, seg, int(host.ctypes.data), n) == (OK, "")
            assert dev.read(back, n) == data
        assert len(fabric.seen) == 2  # it failed the slice; tcp moved it through staging
        assert sum(dev.batches.values()) == 3 and len(a._lanes.staging()) == 1
