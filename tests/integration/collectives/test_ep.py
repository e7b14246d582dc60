"""Elastic EP on 4 real ranks: dispatch -> expert -> combine equals the single-process reference."""

from __future__ import annotations

import pytest

from kvplane.testing.needs import need_module

torch = need_module("torch", "pip install torch==2.13.0")

from tests.support.ep_scenario import WORLD, reference, worker
from tests.support.ranks import RankGroup


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_dispatch_combine_match_reference() -> None:
    with RankGroup(WORLD) as g:
        g.start(worker, False)
        res = g.wait_results(list(range(WORLD)), 50.0)
    for r in range(WORLD):
        normal, ll = res[r]["first"]
        ref = reference(r, set())
        assert torch.allclose(normal, ref, atol=1e-5), r
        assert torch.allclose(ll, ref, atol=1e-5), r
