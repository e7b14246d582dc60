"""Regression: a replacement that calls join_group only after the members already admitted it.

The members' activate_ranks decision lands before the replacement starts waiting; the replacement
must still find that decision (it scans from the epoch at which it posted its request) instead of
waiting for a later one that never comes.
"""

from __future__ import annotations

import os
import signal

import pytest

from kvplane.testing.needs import need_module

torch = need_module("torch", "pip install torch==2.13.0")
import torch.distributed as dist

import kvplane.collectives as kc
from tests.support.ranks import RankContext, RankGroup

pytestmark = [pytest.mark.fault, pytest.mark.timeout(60)]

OPTS = dict(timeout=4.0, heartbeat_timeout=1.2)


def _member(ctx: RankContext) -> list[object]:
    dist.init_process_group("kvplane", store=ctx.store, rank=ctx.rank, world_size=ctx.world_size,
                            pg_options=kc.KvplaneOptions(**OPTS))
    if ctx.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(4)
    w = dist.all_reduce(t, async_op=True)
    w.wait()
    out: list[object] = [t[0].item(), w.failed_ranks_hint.tolist(), kc.sync_after_failure(timeout=4.0)]
    ctx.report("ready")
    assert ctx.command(30.0) == "activate"
    kc.activate_ranks([2], timeout=4.0)
    ctx.report("activated")
    t = torch.ones(4)
    dist.all_reduce(t)
    out += [kc.get_active_ranks().tolist(), t[0].item()]
    return out


def _replacement(ctx: RankContext) -> list[object]:
    dist.init_process_group("kvplane", store=ctx.store, rank=ctx.rank, world_size=ctx.world_size,
                            pg_options=kc.KvplaneOptions(is_extension=True, **OPTS))
    ctx.report("posted")
    assert ctx.command(30.0) == "join"
    kc.join_group(timeout=10.0)
    t = torch.ones(4)
    dist.all_reduce(t)
    return [kc.get_active_ranks().tolist(), t[0].item()]


def test_join_after_members_already_admitted_it() -> None:
    with RankGroup(3) as g:
        g.start(_member)
        for r in (0, 1):
            g.wait_event(r, "ready", 30.0)
        g.start(_replacement, ranks=[2])
        g.wait_event(2, "posted", 30.0)
        for r in (0, 1):
            g.send(r, "activate")
        for r in (0, 1):
            g.wait_event(r, "activated", 30.0)
        g.send(2, "join")
        res = g.wait_results([0, 1, 2], 40.0)
    for r in (0, 1):
        assert res[r][:3] == [2.0, [0, 0, 1], "Reconciled"]
        assert res[r][3:] == [[1, 1, 1], 3.0]
    assert res[2] == [[1, 1, 1], 3.0]
