"""Time models: prefill execution, KV movement and one decode step.

Used twice on purpose: policies call them to *estimate* (Mooncake's EstimatePrefillExecutionTime,
EstimateKVCacheTransferTime), and the simulator calls them to *execute*. The paper fits a
polynomial on offline measurements and reports small error; here the polynomial is derived from
the FLOP count of FAST'25 §2.2, so estimate and execution agree exactly except where the cache
changed between the decision and the start of the prefill. Pure arithmetic; no imports beyond config.
"""

from __future__ import annotations

from kvplane.conductor.scheduling.config import ClusterConfig, ModelConfig


class TimeModel:
    """Prefill, transfer and decode-step times of one model on one cluster.

    Args:
        model: model and hardware constants.
        cluster: link bandwidths and block size.
    """

    __slots__ = ("model", "cluster", "_k1", "_k2", "_decode_fixed", "_decode_per_kv",
                 "_h2d_block", "_nic_block", "_pool_block", "_c0")

    def __init__(self, model: ModelConfig, cluster: ClusterConfig) -> None:
        self.model, self.cluster = model, cluster
        m = model
        rate = m.gpu_flops * m.mfu
        # flops(n) = l·(a·n²·d + b·n·d²)  =>  T(n, p) = c0 + k1·(n − p) + k2·(n² − p²)
        self._k1 = m.layers * m.linear_coeff * m.hidden ** 2 / rate
        self._k2 = m.layers * m.attn_coeff * m.hidden / rate
        self._c0 = m.prefill_overhead_s
        if m.prefill_fit:  # measured on the real instances: replaces the FLOP model
            self._c0, self._k1, self._k2 = m.prefill_fit
        kv = m.kv_bytes_per_token
        hbm = m.hbm_bytes_per_s * m.hbm_efficiency
        self._decode_fixed = m.weight_bytes / hbm
        self._decode_per_kv = kv / hbm
        bt = cluster.block_tokens * kv
        self._h2d_block = bt / cluster.h2d_bytes_per_s
        self._nic_block = bt / cluster.nic_bytes_per_s
        self._pool_block = bt / cluster.pool_bytes_per_s

    def prefix_tokens(self, blocks: int, input_length: int) -> int:
        """Tokens reused by a ``blocks``-long prefix hit (at least one token is always computed)."""
        return max(0, min(blocks * self.cluster.block_tokens, input_length - 1))

    def prefill_s(self, input_length: int, prefix_tokens: int) -> float:
        """Seconds to prefill ``input_length`` tokens when ``prefix_tokens`` are already cached.

        Args:
            input_length: prompt tokens.
            prefix_tokens: tokens whose KV is reused (clamped to ``[0, input_length]``).

        Returns:
            ``c0 + k1·(n − p) + k2·(n² − p²)`` seconds.
        """
        n = max(0, input_length)
        p = min(max(0, prefix_tokens), n)
        return (self._c0 + self._k1 * (n - p)
                + self._k2 * (n * n - p * p))

    def reuse_s(self, cpu_blocks: int = 0, remote_blocks: int = 0, pool_blocks: int = 0) -> float:
        """Seconds to bring reused blocks into GPU memory (GPU-resident blocks are free).

        Args:
            cpu_blocks: blocks loaded from the instance's own DRAM (H2D).
            remote_blocks: blocks pulled from another prefill instance (NIC).
            pool_blocks: blocks read from the shared pool.
        """
        return (cpu_blocks * self._h2d_block + remote_blocks * self._nic_block
                + pool_blocks * self._pool_block)

    def transfer_s(self, blocks: int) -> float:
        """Mooncake's EstimateKVCacheTransferTime: ``blocks`` over the NIC, no congestion."""
        return blocks * self._nic_block

    def decode_step_s(self, batch: int, kv_tokens: float) -> float:
        """Seconds of one decode step for ``batch`` sequences holding ``kv_tokens`` of KV.

        Memory-bound model: read the weights once plus every KV token once, plus a small
        per-sequence cost. Zero for an empty batch.
        """
        if batch <= 0:
            return 0.0
        return (self._decode_fixed + self._decode_per_kv * kv_tokens
                + self.model.decode_seq_overhead_s * batch)
