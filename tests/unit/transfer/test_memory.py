import mmap
import os

import numpy as np
import pytest

from kvplane.common.errors import AddressNotRegistered, Conflict, InvalidArgument, NotFound
from kvplane.testing.needs import requires
from kvplane.transfer.memory import ManagedBuffer, MemoryTable, Region, address_of, view_at


def region_of(obj):
    addr, n, keep = address_of(obj)
    return Region(addr, n, view_at(addr, n), keep=keep)


def test_register_kinds_and_bounds():
    t = MemoryTable()
    arr = np.zeros(4096, np.uint8)
    ba = bytearray(1000)
    mm = mmap.mmap(-1, 8192)
    for obj in (arr, ba, mm):
        t.add(region_of(obj))
    a = arr.ctypes.data
    v = t.view(a + 10, 100)
    v[:] = b"\x07" * 100
    assert arr[10:110].tolist() == [7] * 100 and arr[9] == 0 and arr[110] == 0
    t.find(a, 4096)
    for addr, n in ((a, 4097), (a - 1, 2), (a + 4096, 1), (a + 4000, 200), (a, -1)):
        with pytest.raises(AddressNotRegistered):
            t.find(addr, n)
    mm.close() if False else None


def test_overlap_and_remove():
    t = MemoryTable()
    arr = np.zeros(1 << 16, np.uint8)
    a = arr.ctypes.data
    t.add(Region(a, 4096, view_at(a, 4096)))
    with pytest.raises(Conflict):
        t.add(Region(a + 100, 10, view_at(a + 100, 10)))
    with pytest.raises(Conflict):
        t.add(Region(a - 10, 20, None))
    t.add(Region(a + 4096, 4096, view_at(a + 4096, 4096)))  # adjacent is fine
    t.remove(a)
    with pytest.raises(NotFound):
        t.remove(a)
    with pytest.raises(AddressNotRegistered):
        t.find(a, 1)


def test_rejects_unregistrable():
    with pytest.raises(InvalidArgument):
        address_of(b"immutable")
    with pytest.raises(InvalidArgument):
        address_of(np.zeros((4, 4))[:, 1])
    ro = np.zeros(10)
    ro.flags.writeable = False
    with pytest.raises(InvalidArgument):
        address_of(ro)
    with pytest.raises(InvalidArgument):
        address_of("text")


def test_torch_tensor():
    torch = requires("torch")
    t = torch.zeros(256, dtype=torch.float32)
    addr, n, keep = address_of(t)
    assert addr == t.data_ptr() and n == 1024 and keep is t
    view_at(addr, 4)[:] = np.float32(1.5).tobytes()
    assert t[0].item() == 1.5
    with pytest.raises(InvalidArgument):
        address_of(torch.zeros(4, 4).t())


def test_stale_shared_memory_of_dead_processes_is_swept():
    import subprocess
    import sys

    from kvplane.transfer.memory import sweep_stale_shm

    code = "from kvplane.transfer.memory import ManagedBuffer as M; b = M(4096); print(b.name, flush=True)"
    name = subprocess.run([sys.executable, "-c", code + "; import os; os._exit(0)"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert os.path.exists(f"/dev/shm/{name}")  # the process died without cleaning up
    live = ManagedBuffer(4096)
    try:
        assert sweep_stale_shm() >= 1
        assert not os.path.exists(f"/dev/shm/{name}")
        assert os.path.exists(f"/dev/shm/{live.name}")  # ours is alive: kept
    finally:
        live.close()


def test_managed_buffer_is_shared_memory(tmp_path):
    buf = ManagedBuffer(1 << 20)
    try:
        buf.array[:4] = [1, 2, 3, 4]
        with open(f"/dev/shm/{buf.name}", "rb") as f:
            assert f.read(4) == b"\x01\x02\x03\x04"
    finally:
        buf.close()
    buf.close()  # idempotent
    with pytest.raises(InvalidArgument):
        ManagedBuffer(0)
