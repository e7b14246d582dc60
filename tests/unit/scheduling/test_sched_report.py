"""Experiment helpers: policy specs, load scaling, policy × load comparison, hit ratio by turn."""

import pytest

from kvplane.common.errors import InvalidArgument
from kvplane.conductor.indexer import PrefixIndex
from kvplane.conductor.scheduling.config import ClusterConfig, SimConfig
from kvplane.conductor.scheduling.prefix import TRACE_CONTEXT
from kvplane.conductor.scheduling.report import (
    compare,
    hit_ratio_by_turn,
    parse_spec,
    scaled,
    tier_series,
    tier_setups,
)
from kvplane.conductor.scheduling.simulator import Simulator
from kvplane.conductor.scheduling.view import Request

pytestmark = pytest.mark.timeout(20)
CFG = SimConfig(cluster=ClusterConfig(prefill_instances=2, decode_instances=1))


def sessions(n_sessions=6, turns=4, gap=2.0):
    """Interleaved multi-turn sessions; each turn extends the previous prompt by 3 blocks."""
    out, rid = [], 0
    for t in range(turns):
        for s in range(n_sessions):
            chain = [0] + [1000 * s + k for k in range(1, 3 * (t + 1) + 1)]
            out.append(Request(rid, gap * rid, 512 * len(chain), 20, tuple(chain)))
            rid += 1
    return out


def test_parse_spec():
    assert parse_spec("mooncake") == ("mooncake", {})
    assert parse_spec("mooncake@rejection=none@balancing_threshold=2") == (
        "mooncake", {"policy.rejection": "none", "policy.balancing_threshold": "2"})
    with pytest.raises(InvalidArgument):
        parse_spec("mooncake@oops")


def test_scaled_divides_arrivals():
    reqs = sessions(1, 2)
    assert [r.arrival_s for r in scaled(reqs, 2.0)] == [0.0, 1.0]
    assert scaled(reqs, 1.0) == reqs


def test_compare_reports_every_policy_and_load():
    reps = compare(sessions(), CFG, ["least-loaded", "mooncake@rejection=none"], [1.0, 4.0])
    assert [r.policy for r in reps] == ["least-loaded", "mooncake@rejection=none"]
    for r in reps:
        assert set(r.by_load) == {1.0, 4.0} and set(r.capacity) == {"100ms", "200ms", "300ms"}
        row = r.row()
        assert row["load"] == 1.0 and row["requests"] == 24 and len(row["by_load"]) == 2
        assert row["seed"] == 0
    assert reps[1].by_load[1.0]["hit_ratio"] > reps[0].by_load[1.0]["hit_ratio"]
    with pytest.raises(InvalidArgument):
        compare(sessions(), CFG, [], [1.0])


def test_hit_ratio_grows_with_turns_and_tiers():
    reqs = sessions()
    res = Simulator(CFG, "mooncake").run(reqs)
    by_turn = hit_ratio_by_turn(reqs, res.outcomes)
    assert set(by_turn) == {1, 2, 3, 4}
    assert by_turn[1] < by_turn[2] < by_turn[4]
    setups = tier_setups(CFG, 500)
    assert setups["GPU only"].cluster.cpu_cache_blocks == 0
    assert setups["GPU + CPU + pool"].cluster.pool_blocks == 500
    series = tier_series(reqs, CFG, "least-loaded", 500)
    assert set(series) == set(setups)


def test_simulator_reads_and_feeds_the_conductor_index():
    idx = PrefixIndex()
    reqs = sessions()
    res = Simulator(CFG, "prefix", idx).run(reqs)
    assert res.index_calls >= len(reqs)
    assert idx.stats()["blocks"] == len({h for r in reqs for h in r.hash_ids})
    assert idx.match(TRACE_CONTEXT, reqs[-1].hash_ids)[res.outcomes[-1].prefill].gpu > 0
