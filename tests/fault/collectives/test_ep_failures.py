"""Elastic EP: a killed rank is masked in active_ranks and skipped within timeout_us."""

from __future__ import annotations

import pytest

from kvplane.testing.needs import need_module

torch = need_module("torch", "pip install torch==2.13.0")

from tests.support.ep_scenario import TIMEOUT_US, WORLD, reference, worker
from tests.support.ranks import RankGroup


@pytest.mark.fault
@pytest.mark.timeout(60)
def test_killed_rank_is_masked_within_timeout() -> None:
    with RankGroup(WORLD) as g:
        g.start(worker, True)
        res = g.wait_results([0, 1, 3], 50.0)
    for r in (0, 1, 3):
        assert torch.allclose(res[r]["first"][0], reference(r, set()), atol=1e-5)
        normal, ll = res[r]["second"]
        ref = reference(r, {2})
        assert not torch.allclose(ref, reference(r, set())), "rank 2's experts must matter"
        assert torch.allclose(normal, ref, atol=1e-5), r
        assert torch.allclose(ll, ref, atol=1e-5), r
        assert res[r]["active"] == [1, 1, 0, 1]
        # a full round (six exchanges) returns within one timeout_us: only the first one waits
        assert res[r]["seconds"] < TIMEOUT_US / 1e6, res[r]["seconds"]
