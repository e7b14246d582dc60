"""Device memory in the transfer engine on real CUDA memory: the cases of
tests/integration/transfer/test_engine_device.py (run there on the stand-in device), here with
torch CUDA tensors and ``TorchCopier`` (a side stream, pinned staging), and NIXL's VRAM
registration when nixl is installed.

Skipped with a reason where torch has no CUDA device. Written without a GPU at hand: none of
these has run yet.
"""

import hashlib

import numpy as np
import pytest

from kvplane.transfer import OpCode, TransferEngine, TransferRequest, TransferStatus
from kvplane.transfer.fabric import nixl_available
from tests.support.target import pattern, spawn_target

torch = pytest.importorskip("torch", reason="the CUDA cases need torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda)"),
]
CHUNK = 1 << 20
SIZES = [1000, CHUNK, 3 * CHUNK + 123]
OK = TransferStatus.COMPLETED


@pytest.fixture(scope="module")
def target():
    with spawn_target("--buf-mb", "16") as p:
        yield p


@pytest.fixture(scope="module")
def shm_target():
    with spawn_target("--buf-mb", "16", "--managed") as p:
        yield p


def one(te, op, local, seg, remote, n, timeout=20.0):
    bid = te.allocate_batch(1)
    te.submit(bid, [TransferRequest(op, local, seg, remote, n)], timeout)
    st, err = te.wait(bid, timeout + 5)[0], te.errors(bid)[0]
    te.free_batch(bid)
    return st, err


def digest(t):
    return hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()


def test_a_cuda_tensor_registers_as_device_memory():
    with TransferEngine(protocol="tcp") as te:
        t = torch.zeros(4096, dtype=torch.uint8, device="cuda")
        region = te.register_memory(t)
        assert (region.kind, region.view, region.device) == ("dev", None, str(t.device))
        assert region.addr == t.data_ptr() and region.length == 4096


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("proto", ["tcp", "shm"])
def test_cuda_to_host_and_back(proto, n, target, shm_target):
    peer = target if proto == "tcp" else shm_target
    with TransferEngine(protocol=proto, device_chunk=CHUNK) as te:
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
        back = torch.zeros(n, dtype=torch.uint8, device="cuda")
        te.register_memory(src)
        te.register_memory(back)
        seg = te.open_segment(peer.info["segment"])
        raddr = peer.info["addr"] + 4096
        assert one(te, OpCode.WRITE, src.data_ptr(), seg, raddr, n) == (OK, "")
        want = int(src.cpu().numpy().sum(dtype=np.uint64))
        assert peer.ask(f"sum 4096 {n}")["sum"] == want
        assert one(te, OpCode.READ, back.data_ptr(), seg, raddr, n) == (OK, "")
        torch.cuda.synchronize()
        assert digest(back) == digest(src)


def test_reading_the_targets_pattern_into_cuda(target):
    n = 2 * CHUNK + 5
    with TransferEngine(protocol="tcp", device_chunk=CHUNK) as te:
        dst = torch.zeros(n, dtype=torch.uint8, device="cuda")
        te.register_memory(dst)
        seg = te.open_segment(target.info["segment"])
        assert one(te, OpCode.READ, dst.data_ptr(), seg, target.info["addr"] + 10, n) == (OK, "")
        assert np.array_equal(dst.cpu().numpy(), pattern(n, 10))


def test_a_cuda_region_served_by_this_engines_listener():
    """Another engine (here: a second one in this process) reads and writes our CUDA tensor
    over TCP; our listener stages it through TorchCopier."""
    n = 2 * CHUNK + 7
    with TransferEngine(protocol="tcp", device_chunk=CHUNK) as owner, \
            TransferEngine(protocol="tcp") as peer:
        t = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
        owner.register_memory(t)
        buf = np.zeros(n, np.uint8)
        peer.register_memory(buf)
        seg = peer.open_segment(owner.name)
        assert one(peer, OpCode.READ, int(buf.ctypes.data), seg, t.data_ptr(), n) == (OK, "")
        assert np.array_equal(buf, t.cpu().numpy())
        buf[:] = 3
        assert one(peer, OpCode.WRITE, int(buf.ctypes.data), seg, t.data_ptr(), n) == (OK, "")
        torch.cuda.synchronize()
        assert int(t.sum()) == 3 * n


@pytest.mark.skipif(not nixl_available(), reason="nixl is not installed")
def test_nixl_registers_a_cuda_tensor_as_vram(monkeypatch):
    monkeypatch.setenv("KVPLANE_NIXL", "on")
    with TransferEngine(protocol="nixl") as te:
        t = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
        region = te.register_memory(t)
        nixl = te.transports["nixl"]
        assert region.addr in nixl._regs  # registered with the agent (as VRAM: _mem_type)
        te.unregister_memory(region.addr)
        assert region.addr not in nixl._regs


@pytest.mark.skipif(not nixl_available(), reason="nixl is not installed")
def test_nixl_moves_a_local_cuda_tensor_without_staging(monkeypatch):
    """Local VRAM goes to NIXL as DeviceSlices (``device_kinds``): no staging ring is made."""
    import uuid
    monkeypatch.setenv("KVPLANE_NIXL", "on")
    meta = f"memory://cuda-nixl-{uuid.uuid4().hex}"
    with TransferEngine(protocol="nixl", metadata=meta) as a, \
            TransferEngine(protocol="nixl", metadata=meta) as b:
        n = 3 * CHUNK + 1
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
        a.register_memory(src)
        host = np.zeros(n, np.uint8)
        b.register_memory(host)
        seg = a.open_segment(b.name)
        torch.cuda.synchronize()
        assert one(a, OpCode.WRITE, src.data_ptr(), seg, int(host.ctypes.data), n) == (OK, "")
        assert np.array_equal(host, src.cpu().numpy())
        assert a._lanes.staging() == []


IPC_ENV = {"KVPLANE_TRANSPORTS": "tcp,shm,file,local,cudaipc"}


def test_cuda_ipc_moves_gpu_to_gpu_between_processes_on_one_host():
    """The cudaipc transport opens the target's exported handle and copies GPU to GPU:
    no host staging on this side, bytes checksummed on the other."""
    n = 2 * CHUNK + 3
    with spawn_target("--buf-mb", "1", "--cuda-mb", "8", env=IPC_ENV) as peer, \
            TransferEngine(protocol="auto", transports=("tcp", "shm", "file", "local", "cudaipc")) as te:
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
        back = torch.zeros(n, dtype=torch.uint8, device="cuda")
        te.register_memory(src)
        te.register_memory(back)
        seg = te.open_segment(peer.info["segment"])
        raddr = peer.info["cuda_addr"] + 4096
        torch.cuda.synchronize()
        assert one(te, OpCode.WRITE, src.data_ptr(), seg, raddr, n) == (OK, "")
        assert peer.ask(f"csum 4096 {n}")["sum"] == int(src.cpu().numpy().sum(dtype=np.uint64))
        assert one(te, OpCode.READ, back.data_ptr(), seg, raddr, n) == (OK, "")
        torch.cuda.synchronize()
        assert digest(back) == digest(src)
        assert te._lanes.staging() == []  # nothing went through host staging here
