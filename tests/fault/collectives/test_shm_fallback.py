"""The shared-memory allreduce when a rank cannot use /dev/shm: every rank falls back to the TCP
ring (never a hang, never a mixed result). No room on one rank sends that size class to the ring
for good and frees the others' areas; a rank that could not map a peer's area makes every owner
start a new one, so the next op goes through shared memory again."""

from __future__ import annotations

import os
import subprocess

import pytest

from kvplane.testing.needs import need_module

torch = need_module("torch", "pip install torch==2.13.0")
import torch.distributed as dist

import kvplane.collectives as kc
from kvplane.collectives import schedule, shm
from tests.support.ranks import RankContext, RankGroup

pytestmark = [pytest.mark.fault, pytest.mark.timeout(90)]

N = (3 << 20) // 4 + 7  # 3 MiB of float32 and a bit: uneven blocks, over the 1 MiB threshold


def _x(rank: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(77 + rank)) * 10


def _reference(w: int) -> torch.Tensor:
    xs = [_x(r) for r in range(w)]
    out = torch.empty(N)
    for blk, (lo, hi) in enumerate(schedule.split(N, w)):
        order = schedule.reduction_order(blk, w)
        acc = xs[order[0]][lo:hi].clone()
        for p in order[1:]:
            acc = acc + xs[p][lo:hi]
        out[lo:hi] = acc
    return out


def _worker(ctx: RankContext, mode: str) -> dict[str, object]:
    if mode == "no-room" and ctx.rank == 1:
        shm.SHM_DIR = "/nonexistent-kvplane-test"  # this rank cannot create its area
    if mode == "no-map" and ctx.rank == 2:
        real, calls = shm.ShmArena.peer, []

        def peer(self, inc, aid):  # the first mapping of a peer's area fails
            calls.append(inc)
            return None if len(calls) == 1 else real(self, inc, aid)
        shm.ShmArena.peer = peer
    dist.init_process_group("kvplane", store=ctx.store, rank=ctx.rank, world_size=ctx.world_size,
                            pg_options=kc.KvplaneOptions(timeout=10.0))
    pg = kc._pg(None)
    out: dict[str, object] = {"results": [], "gens": []}
    for _ in range(3):
        t = _x(ctx.rank)
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        out["results"].append((t, work.local_success))
        out["gens"].append(None if pg._shm.id is None else pg._shm.id.gen)
    out["files"] = [f for f in os.listdir("/dev/shm") if f.startswith(f"kvplane-pg-{os.getpid()}-")]
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("mode", ["no-room", "no-map"])
def test_allreduce_falls_back_to_the_ring_and_stays_exact(mode: str) -> None:
    w = 3
    with RankGroup(w) as g:
        g.start(_worker, mode)
        res = g.wait_results(list(range(w)), 80.0)
    ref = _reference(w)
    for r in range(w):
        for t, ok in res[r]["results"]:
            assert ok and torch.equal(t, ref), f"rank {r} ({mode}) got a wrong allreduce"
        assert res[r]["files"] == []
    if mode == "no-room":
        assert res[1]["gens"] == [None] * 3  # rank 1 never had an area: every op ran on the ring
        assert res[0]["gens"] == [None] * 3  # the others dropped theirs after the first refusal
    else:
        # op 1: rank 2 could not map, everyone dropped its area; ops 2-3 ran on new ones
        assert all(res[r]["gens"] == [None, 2, 2] for r in range(w)), [res[r]["gens"] for r in range(w)]


def test_a_full_dev_shm_is_an_error_not_a_sigbus(tmp_path) -> None:
    """posix_fallocate reserves the area up front: on a tmpfs too small for it, creating the
    area fails (and the op would take the ring) instead of a SIGBUS when its pages are touched."""
    small = tmp_path / "shm"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(small)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        old, shm.SHM_DIR = shm.SHM_DIR, str(small)
        arena = shm.ShmArena(0x1234)
        try:
            assert arena.own(1 << 20) is not None  # 1 MiB + its result block fits in 2 MiB
            assert arena.own(4 << 20) is None  # 6 MiB does not: refused, not mapped
            assert os.listdir(small) == []
        finally:
            arena.close()
            shm.SHM_DIR = old
    finally:
        subprocess.run(["umount", str(small)], check=True)
