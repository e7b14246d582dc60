"""Mooncake's KVCache-centric scheduling (FAST'25 Algorithm 1) with early rejection.

Prefill: for every prefill instance estimate ``T_transfer + T_queue + T_prefill``. The instance's
own reusable prefix (device, then its DRAM, then the shared pool if any) is the default; when the
best prefix anywhere exceeds ``balancing_threshold ×`` the local one, the instance may instead
pull the missing blocks from the best holder (``Decision.source``) and keep them, which is how hot
prefixes get replicated. Following §4.3 the pull is taken only when it is estimated faster.
Decode: the instance with the lowest predicted TBT that fits the KV. Rejection (HTTP 429 in a
router): estimated TTFT over the SLO, or predicted TBT over the SLO / KV not fitting. The decode
load is predicted at the time the request reaches decode (running requests are assumed to last
``decode_duration_s``, requests in prefill are counted) for placement and for ``predictive``
rejection, and also for placement when ``rejection="none"``; ``early`` rejection uses the load as
of now for both, as the paper's plain early-rejection baseline does.

Written from the paper's description (docs/reference.md §R2); must not import the
simulator.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvplane.common.errors import InvalidArgument
from kvplane.conductor.indexer import Match
from kvplane.conductor.scheduling.config import PolicyConfig
from kvplane.conductor.scheduling.policy import SchedulingPolicy
from kvplane.conductor.scheduling.timemodel import TimeModel
from kvplane.conductor.scheduling.view import ClusterView, Decision, DecodeLoad, PrefillLoad, Request


@dataclass(frozen=True, slots=True)
class PrefillEstimate:
    """Algorithm 1's estimate for one prefill instance.

    Attributes:
        instance: prefill instance id.
        prefix_blocks: blocks reused (local, pulled or from the pool).
        source: instance the missing prefix is pulled from, or None.
        t_transfer: seconds to bring reused blocks to the GPU (H2D, NIC, pool).
        t_queue: seconds of queued work ahead.
        t_prefill: seconds of prefill execution.
    """

    instance: str
    prefix_blocks: int
    source: str | None
    t_transfer: float
    t_queue: float
    t_prefill: float

    @property
    def ttft(self) -> float:
        """Estimated time to first token."""
        return self.t_transfer + self.t_queue + self.t_prefill


class KVCentricPolicy(SchedulingPolicy):
    """Global cache-aware scheduling with hot-prefix replication and early rejection."""

    name = "mooncake"

    def __init__(self, config: PolicyConfig, time_model: TimeModel, seed: int = 0) -> None:
        super().__init__(config, time_model, seed)
        self.threshold = config.balancing_threshold

    def estimates(self, request: Request, view: ClusterView) -> list[PrefillEstimate]:
        """Algorithm 1's per-instance estimates (exposed for tests and the live router)."""
        matches = view.match(request.hash_ids)
        best_inst, best_len = None, 0
        for p in view.prefill:
            local = matches[p.instance].cpu
            if local > best_len:
                best_inst, best_len = p.instance, local
        return [self._estimate(request, p, matches[p.instance], best_inst, best_len)
                for p in view.prefill]

    def _estimate(self, request: Request, p: PrefillLoad, m: Match,
                  best_inst: str | None, best_len: int) -> PrefillEstimate:
        tm, n = self.time_model, request.input_length
        dram = m.cpu - m.gpu
        prefix, source = m.longest, None
        t_move = tm.reuse_s(cpu_blocks=dram, pool_blocks=m.longest - m.cpu)
        t_run = tm.prefill_s(n, tm.prefix_tokens(prefix, n))
        if best_inst is not None and best_inst != p.instance and best_len > m.longest \
                and best_len > self.threshold * m.cpu:
            pull_move = tm.reuse_s(cpu_blocks=dram, remote_blocks=best_len - m.cpu)
            pull_run = tm.prefill_s(n, tm.prefix_tokens(best_len, n))
            if pull_move + pull_run < t_move + t_run:
                prefix, source, t_move, t_run = best_len, best_inst, pull_move, pull_run
        return PrefillEstimate(p.instance, prefix, source, t_move, p.queue_s, t_run)

    def schedule(self, request: Request, view: ClusterView) -> Decision:
        """Algorithm 1: minimise the estimated TTFT, pick decode by predicted TBT, maybe reject."""
        est = self.estimates(request, view)
        best = min(est, key=lambda e: (e.ttft, self.rng.random()))
        decode, tbt, fits = self.select_decode(request, view, best.ttft)
        c = self.config
        reject = None
        if c.rejection != "none":
            if best.ttft > c.ttft_slo_s:
                reject = "ttft"
            elif not fits:
                reject = "kv"
            elif tbt > c.tbt_slo_s:
                reject = "tbt"
        if reject is not None:
            return Decision(None, None, reject=reject, est_ttft_s=best.ttft, est_tbt_s=tbt)
        return Decision(best.instance, decode.instance, source=best.source,
                        prefix_blocks=best.prefix_blocks, est_ttft_s=best.ttft, est_tbt_s=tbt)

    def select_decode(self, request: Request, view: ClusterView,
                      ttft_s: float) -> tuple[DecodeLoad, float, bool]:
        """Decode instance with the lowest predicted step time among those the KV fits.

        Returns:
            (instance, predicted TBT in seconds, whether the KV fits there).
        """
        at = view.now + ttft_s
        best: tuple[bool, float, float, DecodeLoad] | None = None
        for d in view.decode:
            batch, kv = self._load_at(d, at)
            batch, kv = batch + 1, kv + request.input_length
            fits = kv <= d.kv_capacity and batch <= d.max_batch
            step = self.time_model.decode_step_s(batch, kv)
            cand = (not fits, step, self.rng.random(), d)
            if best is None or cand[:3] < best[:3]:
                best = cand
        if best is None:
            raise InvalidArgument("the cluster view has no decode instance")
        return best[3], best[1], not best[0]

    def _load_at(self, d: DecodeLoad, at: float) -> tuple[int, float]:
        if self.config.rejection == "early":  # the paper's plain early rejection: load as of now
            return d.running + d.waiting, d.kv_tokens
        horizon = at - self.config.decode_duration_s
        batch, kv = d.waiting, 0.0
        for start, tokens in d.starts.values():
            if start > horizon:
                batch, kv = batch + 1, kv + tokens
        for _, tokens in d.incoming.values():
            batch, kv = batch + 1, kv + tokens
        return batch, kv


class KVCentricLocalPolicy(KVCentricPolicy):
    """The paper's *local* cache-aware scheduling: Algorithm 1 without pulling remote prefixes."""

    name = "mooncake-local"

    def __init__(self, config: PolicyConfig, time_model: TimeModel, seed: int = 0) -> None:
        super().__init__(config, time_model, seed)
        self.threshold = float("inf")
