"""The discrete-event simulator on tiny hand-made traces whose answers can be computed by hand."""

from collections import Counter
from dataclasses import replace

import pytest

from kvplane.conductor.scheduling.config import ClusterConfig, ModelConfig, PolicyConfig, SimConfig
from kvplane.conductor.scheduling.outcomes import summarize
from kvplane.conductor.scheduling.simulator import Simulator, simulate
from kvplane.conductor.scheduling.timemodel import TimeModel
from kvplane.conductor.scheduling.view import Request

pytestmark = pytest.mark.timeout(20)


def cfg(prefill=1, decode=1, **cluster):
    return SimConfig(cluster=ClusterConfig(prefill_instances=prefill, decode_instances=decode, **cluster))


def r(rid, t, hashes, n=None, out=10):
    return Request(rid, t, n or 512 * len(hashes), out, tuple(hashes))


def test_single_request_ttft_and_tbt_follow_the_models():
    c = cfg()
    tm = TimeModel(c.model, c.cluster)
    (o,) = simulate([r(0, 1.0, range(8), out=101)], c, "least-loaded").outcomes
    assert o.ttft_s == pytest.approx(tm.prefill_s(4096, 0))
    assert o.hits == (0, 0, 0, 0) and o.prefill == "p0" and o.decode == "d0"
    step = tm.decode_step_s(1, 4096)
    assert step <= o.tbt_s <= tm.decode_step_s(1, 4096 + 100)
    assert o.finish_s - (1.0 + o.ttft_s) == pytest.approx(100 * o.tbt_s, rel=0.01)


def test_repeat_hits_gpu_then_dram_with_h2d_cost():
    c = cfg()
    tm = TimeModel(c.model, c.cluster)
    reqs = [r(0, 0.0, range(8)), r(1, 100.0, range(8))]
    a, b = simulate(reqs, c, "least-loaded").outcomes
    assert b.hits == (8, 0, 0, 0)
    assert b.ttft_s == pytest.approx(tm.prefill_s(4096, 4095))
    small_gpu = cfg(gpu_cache_blocks=4)  # GPU keeps the chain head, DRAM the rest
    a, b = simulate(reqs, small_gpu, "least-loaded").outcomes
    assert b.hits == (4, 4, 0, 0)
    assert b.ttft_s == pytest.approx(tm.reuse_s(cpu_blocks=4) + tm.prefill_s(4096, 4095))


def test_pool_serves_what_local_tiers_lost():
    c = cfg(gpu_cache_blocks=2, cpu_cache_blocks=0, pool_blocks=100)
    reqs = [r(0, 0.0, range(8)), r(1, 50.0, range(100, 108)), r(2, 100.0, range(8))]
    out = simulate(reqs, c, "mooncake").outcomes
    assert out[2].hits == (0, 0, 0, 8)


def test_busy_holder_makes_mooncake_pull_and_replicate():
    chain = list(range(40))
    reqs = [r(0, 0.0, chain),
            r(1, 3.0, chain + list(range(1000, 1080))),  # follows its cache: ~11 s on the holder
            r(2, 4.0, chain + [99]),                     # holder busy: pull the 40 blocks instead
            r(3, 6.0, chain + [98])]                     # now both instances hold the chain
    res = Simulator(cfg(prefill=2), "mooncake").run(reqs)
    o = {x.rid: x for x in res.outcomes}
    holder = o[0].prefill
    assert o[1].prefill == holder and o[1].hits[:2] == (40, 0)
    assert o[2].prefill != holder and o[2].hits == (0, 0, 40, 0) and res.transfers == 1
    assert o[3].prefill == o[2].prefill and o[3].hits == (40, 0, 0, 0)


def test_decode_waits_for_kv_space_and_tbt_shows_it():
    tiny = replace(cfg(), model=replace(ModelConfig(), vram_bytes=(141.2e9 + 8000 * 327_680) / 0.9))
    cap = tiny.model.decode_kv_capacity_tokens
    assert 0 < cap < 10_000
    n = 4000
    reqs = [r(0, 0.0, range(8), n=n, out=cap - n - 10), r(1, 0.0, range(100, 108), n=n, out=50)]
    a, b = simulate(reqs, tiny, "least-loaded").outcomes
    assert b.finish_s > a.finish_s  # b only started decoding after a released its KV
    assert b.tbt_s > 5 * a.tbt_s   # its first gap includes the wait


def test_one_token_outputs_have_no_decode():
    (o,) = simulate([r(0, 0.0, [1], out=1)], cfg(), "random").outcomes
    assert o.tbt_s == 0.0 and o.finish_s == pytest.approx(o.ttft_s)


def test_rejected_requests_are_reported_not_run():
    c = replace(cfg(), policy=PolicyConfig(ttft_slo_s=0.5))
    out = simulate([r(0, 0.0, range(20))], c, "mooncake").outcomes  # 10k tokens take > 0.5 s
    assert out[0].rejected == "ttft" and out[0].prefill is None
    s = summarize(out, c.slo)
    assert s["rejected"] == 1 and s["served"] == 0


def _trap_trace(n=240):
    # every request shares block 0, then its own blocks; a new one every 0.25 s
    return [r(i, 0.25 * i, [0] + [10_000 + 50 * i + k for k in range(15)]) for i in range(n)]


@pytest.mark.parametrize("name", ["prefix", "sglang", "llmd", "mooncake", "mooncake-local"])
def test_shared_head_block_does_not_collapse_routing(name):
    res = simulate(_trap_trace(), cfg(prefill=4, decode=2), name)
    share = Counter(o.prefill for o in res.outcomes)
    assert len(share) == 4 and max(share.values()) < 0.5 * len(res.outcomes), share


def test_runs_are_seeded():
    reqs = _trap_trace(60)
    a = [o.prefill for o in simulate(reqs, replace(cfg(prefill=4), seed=1), "random").outcomes]
    b = [o.prefill for o in simulate(reqs, replace(cfg(prefill=4), seed=1), "random").outcomes]
    c = [o.prefill for o in simulate(reqs, replace(cfg(prefill=4), seed=2), "random").outcomes]
    assert a == b and a != c


def test_every_request_finishes_and_progress_is_reported():
    seen = []
    res = Simulator(cfg(prefill=2, decode=2), "mooncake").run(_trap_trace(300),
                                                              lambda d, t: seen.append((d, t)))
    assert all(o.finish_s is not None for o in res.outcomes if o.rejected is None)
    assert seen[-1] == (300, 300) and (256, 300) in seen
    assert res.index_calls >= 300
