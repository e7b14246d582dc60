"""Every policy's decision on hand-made cluster states (prefixes read through the real PrefixIndex)."""

from collections import Counter

import pytest
from sched_helpers import CAP, TM, policy, req, view

from kvplane.common.errors import InvalidArgument
from kvplane.conductor.scheduling.policy import POLICIES
from kvplane.conductor.scheduling.view import DecodeLoad

pytestmark = pytest.mark.timeout(10)
CHAIN = list(range(100, 120))  # a 20-block conversation prefix


def test_registry_names_and_unknown_name_lists_choices():
    assert POLICIES.names() == sorted(["random", "round-robin", "least-loaded", "prefix", "sglang",
                                       "llmd", "mooncake", "mooncake-local"])
    for name in POLICIES.names():
        assert policy(name).schedule(req(CHAIN), view([0, 0])).prefill in ("p0", "p1")
    with pytest.raises(InvalidArgument, match="least-loaded"):
        policy("nope")


def test_random_is_seeded_and_uses_every_instance():
    a = [policy("random", seed=7).schedule(req([1]), view([0] * 4)).prefill for _ in range(1)]
    p1, p2 = policy("random", seed=7), policy("random", seed=7)
    v = view([0] * 4)
    seq1 = [p1.schedule(req([1]), v).prefill for _ in range(40)]
    seq2 = [p2.schedule(req([1]), v).prefill for _ in range(40)]
    assert seq1 == seq2 and a[0] == seq1[0]
    assert set(seq1) == {"p0", "p1", "p2", "p3"}


def test_round_robin_cycles_both_pools():
    p, v = policy("round-robin"), view([9, 0, 0])
    got = [p.schedule(req([1]), v) for _ in range(4)]
    assert [d.prefill for d in got] == ["p0", "p1", "p2", "p0"]
    assert [d.decode for d in got] == ["d0", "d1", "d0", "d1"]


def test_least_loaded_ignores_cache_and_takes_shortest_queue():
    v = view([0.5, 3.0, 0.2], gpu={"p1": CHAIN})
    d = policy("least-loaded").schedule(req(CHAIN), v)
    assert d.prefill == "p2" and d.source is None


def test_least_loaded_decode_counts_incoming_kv():
    busy = DecodeLoad("d0", kv_capacity=CAP, max_batch=256, incoming={1: (5.0, 90_000)})
    idle = DecodeLoad("d1", kv_capacity=CAP, max_batch=256, kv_tokens=10_000, running=1)
    assert policy("least-loaded").schedule(req([1]), view([0], decode=[busy, idle])).decode == "d1"


def test_prefix_prefers_longest_local_match():
    v = view([5.0, 0.0], gpu={"p0": CHAIN[:10], "p1": CHAIN[:3]})
    d = policy("prefix").schedule(req(CHAIN), v)
    assert d.prefill == "p0" and d.prefix_blocks == 10


def test_prefix_counts_dram_after_gpu():
    v = view([0, 0], gpu={"p0": CHAIN[:4], "p1": CHAIN[:2]}, cpu={"p1": CHAIN[:12]})
    assert policy("prefix").schedule(req(CHAIN), v).prefill == "p1"


def test_prefix_trap_shared_head_block_does_not_capture_traffic():
    # conversation trace: every request starts with block 0; only p0 has seen it so far
    v = view([4.0, 0.0, 0.0, 0.0], gpu={"p0": [0]})
    p = policy("prefix")
    picks = Counter(p.schedule(req([0, 1000 + i, 2000 + i]), v).prefill for i in range(200))
    assert picks["p0"] == 0 and len(picks) == 3  # ties among idle instances are spread
    # the degenerate rule (any match wins) is exactly the trap
    greedy = policy("prefix", prefix_min_blocks=1)
    assert {greedy.schedule(req([0, 1000 + i]), v).prefill for i in range(50)} == {"p0"}


def test_sglang_balances_when_imbalanced():
    v = view([0, 0], gpu={"p0": CHAIN})
    v.prefill[0].queued, v.prefill[1].queued = 9, 1
    assert policy("sglang").schedule(req(CHAIN), v).prefill == "p1"


def test_sglang_follows_cache_above_threshold_else_smallest_tree():
    v = view([0, 0, 0], gpu={"p0": CHAIN[:8], "p1": list(range(500, 900))})
    assert policy("sglang").schedule(req(CHAIN), v).prefill == "p0"  # 8/20 > 0.3
    low = policy("sglang").schedule(req(CHAIN[:2] + list(range(3000, 3018))), view(
        [0, 0, 0], gpu={"p0": CHAIN[:2], "p1": list(range(500, 900)), "p2": [7]}))
    assert low.prefill == "p2"  # 2/20 below threshold: smallest cache (p2 has 1 block)


def test_llmd_weighs_prefix_against_queue():
    p = policy("llmd")
    # queue scores are min-max normalised: p0 0.8, p1 1.0, p2 0.0
    v = view([0.2, 0.0, 1.0], gpu={"p0": CHAIN})
    scores = p.scores(req(CHAIN), v)
    assert scores["p0"] == pytest.approx(1.0 + 0.8 + (1 - 20 / 1000))
    assert scores["p1"] == pytest.approx(0.0 + 1.0 + 1.0)
    assert p.schedule(req(CHAIN), v).prefill == "p0"
    v2 = view([0.2, 0.0, 1.0], gpu={"p0": CHAIN[:2]})
    assert p.schedule(req(CHAIN), v2).prefill == "p1"  # 2/20 prefix loses to the queue score
    cpu_only = view([0, 0], gpu={"p0": CHAIN[:5]}, cpu={"p1": CHAIN[:5]})
    s = p.scores(req(CHAIN), cpu_only)
    assert s["p0"] - s["p1"] == pytest.approx(5 * 0.2 / 20 - 5 / 1000)  # GPU 1.0 vs CPU 0.8


def test_mooncake_minimises_transfer_queue_prefill():
    n = 20 * 512
    cheap_hit = view([0.02, 0.0], gpu={"p0": CHAIN})  # 20 ms queue < 39 ms pull
    d = policy("mooncake").schedule(req(CHAIN), cheap_hit)
    assert d.prefill == "p0" and d.source is None and d.prefix_blocks == 20
    assert d.est_ttft_s == pytest.approx(0.02 + TM.prefill_s(n, n - 1))
    # p0 is busy: p1 pulls the prefix from p0 (hot-prefix replication) instead of recomputing
    busy = view([60.0, 0.0], gpu={"p0": CHAIN})
    d = policy("mooncake").schedule(req(CHAIN), busy)
    assert (d.prefill, d.source, d.prefix_blocks) == ("p1", "p0", 20)
    assert d.est_ttft_s == pytest.approx(TM.transfer_s(20) + TM.prefill_s(n, n - 1))


def test_mooncake_local_never_pulls():
    busy = view([60.0, 0.0], gpu={"p0": CHAIN})
    d = policy("mooncake-local").schedule(req(CHAIN), busy)
    assert d.prefill == "p1" and d.source is None and d.prefix_blocks == 0


def test_mooncake_balancing_threshold_keeps_good_local_prefix():
    v = view([60.0, 0.0], gpu={"p0": CHAIN, "p1": CHAIN[:15]})
    d = policy("mooncake", balancing_threshold=2.0).schedule(req(CHAIN), v)
    assert d.prefill == "p1" and d.source is None and d.prefix_blocks == 15  # 20 <= 2 × 15
    d = policy("mooncake", balancing_threshold=1.0).schedule(req(CHAIN), v)
    assert d.source == "p0"


def test_mooncake_uses_dram_and_pool_with_their_costs():
    v = view([0, 0], gpu={"p0": CHAIN[:5]}, cpu={"p0": CHAIN[:10]}, pool=CHAIN)
    est = {e.instance: e for e in policy("mooncake").estimates(req(CHAIN), v)}
    assert est["p0"].prefix_blocks == 20 and est["p1"].prefix_blocks == 20
    assert est["p0"].t_transfer == pytest.approx(TM.reuse_s(cpu_blocks=5, pool_blocks=10))
    assert est["p1"].t_transfer == pytest.approx(TM.reuse_s(pool_blocks=20))


def test_mooncake_rejects_when_ttft_slo_unreachable():
    d = policy("mooncake").schedule(req(CHAIN), view([40.0, 45.0]))
    assert d.rejected and d.reject == "ttft" and d.prefill is None
    d = policy("mooncake", rejection="none").schedule(req(CHAIN), view([40.0, 45.0]))
    assert not d.rejected and d.prefill == "p0"


def test_mooncake_decode_prefers_lower_predicted_tbt():
    heavy = DecodeLoad("d0", running=100, kv_tokens=900_000, kv_capacity=CAP, max_batch=256,
                       starts={i: (0.0, 9000) for i in range(100)})
    light = DecodeLoad("d1", running=2, kv_tokens=20_000, kv_capacity=CAP, max_batch=256,
                       starts={i: (0.0, 10_000) for i in range(100, 102)})
    d = policy("mooncake").schedule(req(CHAIN), view([0], decode=[heavy, light]))
    assert d.decode == "d1" and d.est_tbt_s == pytest.approx(TM.decode_step_s(3, 20_000 + 20 * 512))


def test_early_vs_predictive_rejection():
    # d0 is full now, but every sequence started long ago and will be gone when this one arrives
    old = DecodeLoad("d0", running=200, kv_tokens=CAP - 1000, kv_capacity=CAP, max_batch=256,
                     starts={i: (-100.0, (CAP - 1000) // 200) for i in range(200)})
    assert policy("mooncake", rejection="early").schedule(req(CHAIN), view([0], decode=[old])).reject == "kv"
    predictive = policy("mooncake", rejection="predictive")
    assert not predictive.schedule(req(CHAIN), view([0], decode=[old])).rejected
    # d0 is empty now, but requests already in prefill will fill it first
    coming = DecodeLoad("d0", kv_capacity=CAP, max_batch=256,
                        incoming={i: (1.0, (CAP - 1000) // 100) for i in range(100)})
    assert not policy("mooncake", rejection="early").schedule(req(CHAIN), view([0], decode=[coming])).rejected
    predictive = policy("mooncake", rejection="predictive")
    assert predictive.schedule(req(CHAIN), view([0], decode=[coming])).reject == "kv"


def test_mooncake_rejects_on_tbt_slo():
    d = DecodeLoad("d0", running=10, kv_tokens=100_000, kv_capacity=CAP, max_batch=256,
                   starts={i: (0.0, 10_000) for i in range(10)})
    got = policy("mooncake", tbt_slo_s=0.01).schedule(req(CHAIN), view([0], decode=[d]))
    assert got.reject == "tbt"
