"""Every constant of the scheduling simulator, in one place, each with where it comes from.

Sources are abbreviated: **FAST'25** = Mooncake, FAST'25 paper (Table 1 and §2.2, §5); **trace** =
statistics of ``conversation_trace.jsonl`` (docs/reference.md §R4); **spec** = the
vendor data sheet of the part; **assumed** = our choice, not measured anywhere, stated so it can be
changed. Only frozen dataclasses here; no I/O. Must not import the simulator or the policies.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from kvplane.common.errors import InvalidArgument

Rejection = Literal["none", "early", "predictive"]


@dataclass(frozen=True)
class ModelConfig:
    """The served model and one instance's hardware (LLaMA3-70B on 8×A800 by default).

    Attributes:
        layers: transformer layers ``l`` (FAST'25 Table 1: 80).
        hidden: hidden size ``d`` (FAST'25 Table 1: 8192).
        attn_coeff: ``a`` in ``flops(n) = l·(a·n²·d + b·n·d²)`` (FAST'25 §2.2: 4).
        linear_coeff: ``b`` in the same formula (FAST'25 §2.2: 22).
        gqa: grouped-query factor (FAST'25 Table 1: 8).
        dtype_bytes: bytes per KV element (FAST'25 Table 1: 2, fp16/bf16).
        params: parameter count, for the decode weight read (LLaMA3-70B: 70.6e9; model card).
        gpu_flops: dense bf16 FLOP/s of one instance (FAST'25 Table 1: 8 × 312 TFLOPS, A800).
        mfu: fraction of ``gpu_flops`` a prefill achieves (assumed 0.5; same as the reference
            model in docs/reference.md §R5; prefill of 12k tokens then takes ≈ 1.4 s).
        prefill_overhead_s: fixed cost per prefill (assumed 0.01 s: launch, scheduling).
        hbm_bytes_per_s: HBM bandwidth of one instance (spec: 8 × 2.039 TB/s, A800 80GB SXM).
        hbm_efficiency: achieved fraction of HBM bandwidth in a decode step (assumed 0.5).
        decode_seq_overhead_s: per-sequence cost of one decode step (assumed 0.2 ms: sampling,
            scheduling, small kernels).
        vram_bytes: device memory of one instance (spec: 8 × 80 GB).
        vram_reserve: fraction of VRAM not usable for KV after weights (assumed 0.1:
            activations, fragmentation).
        decode_max_batch: most sequences one decode instance runs at once (assumed 256).
        prefill_fit: ``(c0, k1, k2)`` measured on real instances: seconds, seconds per token,
            seconds per token². When set it replaces the FLOP-derived prefill polynomial
            (``benchmarks/router.py`` fits it on vLLM CPU instances); empty = derived.
    """

    layers: int = 80
    hidden: int = 8192
    attn_coeff: float = 4.0
    linear_coeff: float = 22.0
    gqa: int = 8
    dtype_bytes: int = 2
    params: float = 70.6e9
    gpu_flops: float = 8 * 312e12
    mfu: float = 0.5
    prefill_overhead_s: float = 0.01
    hbm_bytes_per_s: float = 8 * 2.039e12
    hbm_efficiency: float = 0.5
    decode_seq_overhead_s: float = 0.0002
    vram_bytes: float = 8 * 80e9
    vram_reserve: float = 0.1
    decode_max_batch: int = 256
    prefill_fit: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.prefill_fit and (len(self.prefill_fit) != 3 or min(self.prefill_fit) < 0):
            raise InvalidArgument("prefill_fit must be three non-negative numbers c0,k1,k2")

    @property
    def kv_bytes_per_token(self) -> int:
        """``l · 2 · (d/gqa) · s``: 327,680 B for LLaMA3-70B (FAST'25 §2.2: "320 KB")."""
        return self.layers * 2 * (self.hidden // self.gqa) * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        """Bytes of weights read per decode step."""
        return self.params * self.dtype_bytes

    @property
    def decode_kv_capacity_tokens(self) -> int:
        """Tokens of KV one decode instance can hold: VRAM minus weights minus the reserve."""
        free = self.vram_bytes * (1.0 - self.vram_reserve) - self.weight_bytes
        return max(0, int(free // self.kv_bytes_per_token))


@dataclass(frozen=True)
class ClusterConfig:
    """Instances, caches and links.

    Attributes:
        prefill_instances: X prefill instances (paper-like default 8: FAST'25 uses 16 nodes and
            reports a best P/D ratio of about 1:1).
        decode_instances: Y decode instances (8, see above).
        block_tokens: tokens per trace block (trace format: 512).
        gpu_cache_blocks: GPU prefix-cache capacity per prefill instance, in blocks (assumed
            1,000 blocks = 512k tokens ≈ 168 GB of the 640 GB left after weights and activations).
        cpu_cache_blocks: local DRAM cache per prefill instance (FAST'25 §5: 3M tokens ≈ 1 TB,
            i.e. 5,860 blocks of 512). 0 disables the tier.
        pool_blocks: shared KV pool (the kvplane store) capacity in blocks; 0 disables it.
        h2d_bytes_per_s: local DRAM → GPU bandwidth (FAST'25 Table 1: B_h2d = 128 GB/s).
        nic_bytes_per_s: instance-to-instance KV transfer (FAST'25 §5: transfer engine 87 GB/s
            on 4×200 Gbps).
        pool_bytes_per_s: shared pool → GPU bandwidth (assumed equal to the NIC: the pool is
            remote DRAM reached over RDMA).
        load: arrival-rate multiplier; timestamps are divided by it.
    """

    prefill_instances: int = 8
    decode_instances: int = 8
    block_tokens: int = 512
    gpu_cache_blocks: int = 1000
    cpu_cache_blocks: int = 5860
    pool_blocks: int = 0
    h2d_bytes_per_s: float = 128e9
    nic_bytes_per_s: float = 87e9
    pool_bytes_per_s: float = 87e9
    load: float = 1.0

    def __post_init__(self) -> None:
        if self.prefill_instances < 1 or self.decode_instances < 1:
            raise InvalidArgument("need at least one prefill and one decode instance")
        if self.block_tokens < 1 or self.load <= 0:
            raise InvalidArgument("block_tokens and load must be > 0")
        if min(self.gpu_cache_blocks, self.cpu_cache_blocks, self.pool_blocks) < 0:
            raise InvalidArgument("cache capacities must be >= 0")


@dataclass(frozen=True)
class SloConfig:
    """Service-level objectives (FAST'25 §5).

    Attributes:
        ttft_s: TTFT bound of an effective request (FAST'25: 30 s).
        tbt_thresholds_s: TBT bounds I/II/III (FAST'25: 100, 200, 300 ms).
        attainment: share of requests that must meet the SLO for a load to count as
            sustained (issue 5: 90 %).
    """

    ttft_s: float = 30.0
    tbt_thresholds_s: tuple[float, ...] = (0.1, 0.2, 0.3)
    attainment: float = 0.9


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of the routing policies (one dataclass so every policy is built the same way).

    Attributes:
        prefix_min_blocks: ``prefix`` ignores matches shorter than this (2: the conversation
            trace shares its first block across all requests, docs/reference.md §R4).
        sglang_cache_threshold: SGLang ``cache_threshold`` (router_args.py default 0.3).
        sglang_balance_abs: SGLang ``balance_abs_threshold`` in queued requests (SGLang's 64
            counts running requests of a colocated engine; scaled to our FIFO prefill queues: 4).
        sglang_balance_rel: SGLang ``balance_rel_threshold`` (router_args.py default 1.5).
        llmd_weights: llm-d scorer weights (prefix, queue, kv-usage), EPP default 1:1:1.
        llmd_tier_weights: llm-d per-tier prefix weights (GPU 1.0, CPU 0.8).
        balancing_threshold: Mooncake's ``kvcache_balancing_threshold``: an instance pulls the
            best remote prefix when ``best_len > threshold × local_len`` (FAST'25 Alg. 1; "set
            manually"; assumed 1.0). ``inf`` gives the paper's *local* cache-aware policy.
        ttft_slo_s: Mooncake rejects when the estimated TTFT exceeds this (FAST'25: 30 s).
        tbt_slo_s: Mooncake rejects when the predicted TBT exceeds this (Threshold III, 0.3 s).
        rejection: ``none``, ``early`` (current decode load, also used for decode placement) or
            ``predictive`` (decode load predicted at the time the request reaches decode;
            arXiv report). ``none`` still places decode by the predicted load.
        decode_duration_s: uniform decode duration assumed by predictive rejection (assumed
            10 s ≈ 343 mean output tokens (trace) × ~30 ms).
    """

    prefix_min_blocks: int = 2
    sglang_cache_threshold: float = 0.3
    sglang_balance_abs: int = 4
    sglang_balance_rel: float = 1.5
    llmd_weights: tuple[float, float, float] = (1.0, 1.0, 1.0)
    llmd_tier_weights: tuple[float, float] = (1.0, 0.8)
    balancing_threshold: float = 1.0
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.3
    rejection: Rejection = "predictive"
    decode_duration_s: float = 10.0

    def __post_init__(self) -> None:
        if self.rejection not in ("none", "early", "predictive"):
            raise InvalidArgument(f"rejection must be none|early|predictive, got {self.rejection!r}")
        if self.balancing_threshold < 0:
            raise InvalidArgument("balancing_threshold must be >= 0")


@dataclass(frozen=True)
class SimConfig:
    """The whole simulator configuration.

    Attributes:
        model: model and hardware constants.
        cluster: instances, caches, links, load.
        slo: service-level objectives.
        policy: policy knobs.
        seed: seed of every random choice (policies, tie breaks); logged with each run.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    seed: int = 0

    def with_overrides(self, overrides: dict[str, str]) -> SimConfig:
        """Return a copy with ``section.field=value`` strings applied (CLI ``--set``).

        Raises:
            InvalidArgument: unknown section or field, or a value that does not parse.
        """
        parts: dict[str, Any] = {"model": self.model, "cluster": self.cluster, "slo": self.slo,
                                 "policy": self.policy}
        for key, text in overrides.items():
            section, _, name = key.partition(".")
            part = parts.get(section)
            if part is None or name not in {f.name for f in fields(part)}:
                raise InvalidArgument(f"unknown setting {key!r}; sections: model, cluster, slo, policy")
            parts[section] = replace(part, **{name: _parse(text, getattr(part, name))})
        return replace(self, **parts)


def _parse(text: str, current: object) -> object:
    try:
        if isinstance(current, bool):
            return text.lower() in ("1", "true", "yes", "on")
        if isinstance(current, int):
            return int(text)
        if isinstance(current, float):
            return float(text)
        if isinstance(current, tuple):
            return tuple(float(x) for x in text.split(",") if x)
    except ValueError as exc:
        raise InvalidArgument(f"cannot parse {text!r}") from exc
    return text
