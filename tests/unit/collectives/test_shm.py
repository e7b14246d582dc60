"""The shared-memory arena of the collectives: size classes, area ids, file lifetimes."""

from __future__ import annotations

import os

import pytest

from kvplane.testing.needs import need_module

torch = need_module("torch", "pip install torch==2.13.0")

from kvplane.collectives import shm

pytestmark = pytest.mark.timeout(20)


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("n", [1, 4096, 1 << 20, (1 << 20) + 1, 3 << 20, 64 << 20, (64 << 20) + 1, 10**9])
def test_size_class_holds_the_input_and_wastes_at_most_a_quarter(n):
    cap = shm._cap(n)
    assert cap >= n and cap % 64 == 0
    assert cap == 1 << 20 if n <= 1 << 20 else cap <= n * 1.25 + (1 << 18)


def test_area_id_round_trips_and_is_never_zero():
    for aid in (shm.AreaId(1, 1, 1 << 20), shm.AreaId(4_194_304, 2**32 - 1, 3 << 40)):
        assert aid.pack() != 0 and shm.AreaId.unpack(aid.pack()) == aid


def test_peer_sees_the_owners_bytes_and_settling_removes_only_the_file(shm_dir):
    owner, reader = shm.ShmArena(0xA), shm.ShmArena(0xB)
    try:
        area = owner.own(3 << 20)
        assert area is not None and owner.id is not None and len(os.listdir(shm_dir)) == 1
        area.inputs[:5].copy_(torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8))
        seen = reader.peer(0xA, owner.id)
        assert seen is not None and seen.inputs[:5].tolist() == [1, 2, 3, 4, 5]
        owner.settle()
        assert os.listdir(shm_dir) == []  # the file is gone ...
        area.result[:2].copy_(torch.tensor([9, 8], dtype=torch.uint8))
        assert seen.result[:2].tolist() == [9, 8]  # ... the shared memory is not
        assert reader.peer(0xA, owner.id) is seen  # cached by id
        assert owner.own(1 << 20) is area  # a smaller input reuses the area
        first = owner.id
        owner.renew()
        assert owner.own(1 << 20) is not None and owner.id.gen == first.gen + 1
        assert reader.peer(0xA, first) is seen  # the old id still maps to what was mapped
    finally:
        owner.close()
        reader.close()
    assert os.listdir(shm_dir) == []


def test_missing_or_short_area_is_refused_not_mapped(shm_dir):
    reader = shm.ShmArena(0xB)
    assert reader.peer(0xC, shm.AreaId(os.getpid(), 1, 1 << 20)) is None  # no such file
    path = shm._path(os.getpid(), 0xC, 2)
    with open(path, "wb") as f:
        f.write(b"x" * 100)  # shorter than the id says
    assert reader.peer(0xC, shm.AreaId(os.getpid(), 2, 1 << 20)) is None
    reader.forget(0xC)
    assert not os.path.exists(path)


def test_files_of_dead_owners_are_swept_and_live_ones_kept(shm_dir):
    with open("/proc/sys/kernel/pid_max") as f:
        dead = int(f.read())  # pids stay below pid_max: no process has this one
    stale = shm_dir / f"kvplane-pg-{dead}-0000000d-1"
    live = shm_dir / f"kvplane-pg-{os.getpid()}-0000000e-1"
    other = shm_dir / "not-ours"
    for p in (stale, live, other):
        p.write_bytes(b"")
    arena = shm.ShmArena(0xF)  # creating an arena sweeps
    arena.close()
    assert sorted(os.listdir(shm_dir)) == sorted([live.name, other.name])


def test_refused_size_class_is_not_retried(shm_dir):
    arena = shm.ShmArena(0x10)
    try:
        assert arena.own(2 << 20) is not None
        arena.refuse(2 << 20)
        assert arena.id is None and os.listdir(shm_dir) == []
        assert arena.own(4 << 20) is None and arena.own(2 << 20) is None
        assert arena.own(1 << 20) is not None  # a smaller class still may
    finally:
        arena.close()
