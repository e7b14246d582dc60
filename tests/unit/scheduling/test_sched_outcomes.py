"""Metrics: TBT as the paper defines it, summaries, SLO attainment and effective capacity."""

import pytest

from kvplane.conductor.scheduling.config import SloConfig
from kvplane.conductor.scheduling.outcomes import Outcome, capacity, effective, summarize, tbt

pytestmark = pytest.mark.timeout(10)
SLO = SloConfig()


def test_tbt_is_mean_of_longest_ten_percent():
    gaps = [(0.05, 18.0), (1.0, 2.0)]  # 20 gaps: the longest 2 are 1.0 s
    assert tbt(gaps) == pytest.approx(1.0)
    assert tbt([(0.05, 17.0), (1.0, 1.0), (0.5, 2.0)]) == pytest.approx(0.75)
    assert tbt([(0.02, 100.0)]) == pytest.approx(0.02)
    assert tbt([]) == 0.0


def test_tbt_rounds_up_and_handles_fractional_counts():
    assert tbt([(0.1, 5.0), (0.3, 1.0)]) == pytest.approx(0.3)  # ceil(0.6) = 1 gap
    assert tbt([(0.1, 9.0), (0.2, 0.5), (0.4, 0.5)]) == pytest.approx(0.3)  # 1 gap = 0.5×0.4 + 0.5×0.2


def test_tbt_adds_decode_queueing_to_the_first_gap():
    assert tbt([(0.05, 20.0)], first_extra=2.0) == pytest.approx((2.05 + 0.05) / 2)


def _o(rid, ttft, tbt_s, rejected=None, hits=(0, 0, 0, 0), blocks=4):
    return Outcome(rid, 0.0, blocks, rejected, "p0", "d0", ttft, tbt_s, 1.0, hits)


def test_effective_and_summary():
    outs = [_o(0, 1.0, 0.05, hits=(2, 1, 0, 0)), _o(1, 40.0, 0.05), _o(2, 2.0, 0.25, hits=(0, 0, 4, 0)),
            Outcome(3, 0.0, 4, rejected="ttft")]
    assert effective(outs[0], SLO, 0.1) and not effective(outs[1], SLO, 0.3)
    assert not effective(outs[3], SLO, 0.3)
    s = summarize(outs, SLO)
    assert s["requests"] == 4 and s["served"] == 3 and s["rejected"] == 1
    assert s["ttft_mean_s"] == pytest.approx(43 / 3)
    assert s["ttft_p50_s"] == pytest.approx(2.0)
    assert s["slo_attainment_by_tbt"] == {"100ms": 0.25, "200ms": 0.25, "300ms": 0.5}
    assert s["slo_attainment"] == 0.5
    assert s["hit_ratio"] == pytest.approx(7 / 12)
    assert s["hit_ratio_by_tier"] == pytest.approx({"gpu": 2 / 12, "cpu": 1 / 12, "remote": 4 / 12,
                                                    "pool": 0.0})


def test_summary_of_nothing_served():
    s = summarize([Outcome(0, 0.0, 1, rejected="kv")], SLO)
    assert s["ttft_mean_s"] is None and s["hit_ratio"] == 0.0 and s["slo_attainment"] == 0.0


def test_capacity_is_highest_load_before_the_first_failure():
    att = {1.0: {"100ms": 0.95, "300ms": 0.99}, 1.5: {"100ms": 0.85, "300ms": 0.93},
           2.0: {"100ms": 0.95, "300ms": 0.5}}
    assert capacity(att, SLO) == {"100ms": 1.0, "300ms": 1.5}
    assert capacity({1.0: {"100ms": 0.1}}, SLO) == {"100ms": None}
