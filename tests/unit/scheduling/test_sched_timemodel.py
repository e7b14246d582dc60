"""Time models: the FAST'25 FLOP polynomial, KV movement, the decode step, derived capacities."""

import pytest

from kvplane.common.errors import InvalidArgument
from kvplane.conductor.scheduling.config import ClusterConfig, ModelConfig, SimConfig
from kvplane.conductor.scheduling.timemodel import TimeModel

pytestmark = pytest.mark.timeout(10)
M, C = ModelConfig(), ClusterConfig()
TM = TimeModel(M, C)


def flops(n):
    return M.layers * (M.attn_coeff * n * n * M.hidden + M.linear_coeff * n * M.hidden ** 2)


def test_prefill_is_the_flop_polynomial():
    for n, p in [(1, 0), (12_000, 0), (12_000, 8_000), (128_000, 64_000)]:
        want = M.prefill_overhead_s + (flops(n) - flops(p)) / (M.gpu_flops * M.mfu)
        assert TM.prefill_s(n, p) == pytest.approx(want)


def test_prefill_matches_the_reference_sanity_numbers():
    # docs/reference.md §R5: 12k tokens ≈ 1.4 s, 128k ≈ 46.5 s at MFU 0.5
    assert TM.prefill_s(12_000, 0) == pytest.approx(1.44, abs=0.02)
    assert TM.prefill_s(128_000, 0) == pytest.approx(46.5, abs=0.1)


def test_prefill_decreases_with_prefix_and_clamps():
    assert TM.prefill_s(8192, 4096) < TM.prefill_s(8192, 0)
    assert TM.prefill_s(100, 500) == pytest.approx(M.prefill_overhead_s)
    assert TM.prefix_tokens(3, 2000) == 1536
    assert TM.prefix_tokens(4, 2000) == 1999  # one token is always computed
    assert TM.prefix_tokens(0, 10) == 0


def test_kv_bytes_and_transfer_times():
    assert M.kv_bytes_per_token == 327_680  # FAST'25: "320 KB" per token for LLaMA3-70B
    block = 512 * 327_680
    assert TM.transfer_s(10) == pytest.approx(10 * block / 87e9)
    assert TM.reuse_s(cpu_blocks=2, remote_blocks=3, pool_blocks=1) == pytest.approx(
        2 * block / 128e9 + 3 * block / 87e9 + block / 87e9)
    assert TM.reuse_s() == 0.0


def test_decode_step_model():
    assert TM.decode_step_s(0, 0) == 0.0
    one = TM.decode_step_s(1, 0)
    assert one == pytest.approx(141.2e9 / (8 * 2.039e12 * 0.5) + 0.0002)
    assert TM.decode_step_s(2, 1000) > one
    full = TM.decode_step_s(256, M.decode_kv_capacity_tokens)
    assert 0.05 < full < 0.2  # a full A800 node: tens of ms, not seconds


def test_decode_capacity_is_vram_minus_weights():
    want = int((640e9 * 0.9 - 141.2e9) // 327_680)
    assert M.decode_kv_capacity_tokens == want


def test_config_validation_and_overrides():
    with pytest.raises(InvalidArgument):
        ClusterConfig(prefill_instances=0)
    cfg = SimConfig().with_overrides({"model.mfu": "0.4", "policy.rejection": "none",
                                      "cluster.pool_blocks": "100", "slo.tbt_thresholds_s": "0.1,0.2"})
    assert cfg.model.mfu == 0.4 and cfg.policy.rejection == "none" and cfg.cluster.pool_blocks == 100
    assert cfg.slo.tbt_thresholds_s == (0.1, 0.2)
    with pytest.raises(InvalidArgument):
        SimConfig().with_overrides({"model.nope": "1"})
    with pytest.raises(InvalidArgument):
        SimConfig().with_overrides({"policy.rejection": "sometimes"})
    with pytest.raises(InvalidArgument):
        SimConfig().with_overrides({"cluster.pool_blocks": "many"})
