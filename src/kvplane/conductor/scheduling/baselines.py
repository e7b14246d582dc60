"""Baseline policies: random, round-robin, least-loaded, prefix-only, SGLang-style, llm-d-style.

Each is our own reading of the public description in docs/reference.md §R3, adapted to
a prefill/decode cluster: the named rule picks the prefill instance, and the decode instance is the
least-loaded one (random/round-robin use their own rule for both). None of them rejects.
Must not import the simulator.
"""

from __future__ import annotations

from kvplane.conductor.indexer import Match
from kvplane.conductor.scheduling.config import PolicyConfig
from kvplane.conductor.scheduling.policy import SchedulingPolicy
from kvplane.conductor.scheduling.timemodel import TimeModel
from kvplane.conductor.scheduling.view import ClusterView, Decision, PrefillLoad, Request


class RandomPolicy(SchedulingPolicy):
    """Uniformly random prefill and decode instances (seeded)."""

    name = "random"

    def schedule(self, request: Request, view: ClusterView) -> Decision:
        """Pick both instances at random."""
        return Decision(self.rng.choice(view.prefill).instance, self.rng.choice(view.decode).instance)


class RoundRobinPolicy(SchedulingPolicy):
    """Cycle through prefill and decode instances independently."""

    name = "round-robin"

    def __init__(self, config: PolicyConfig, time_model: TimeModel, seed: int = 0) -> None:
        super().__init__(config, time_model, seed)
        self._p = self._d = 0

    def schedule(self, request: Request, view: ClusterView) -> Decision:
        """Next instance of each pool in turn."""
        p = view.prefill[self._p % len(view.prefill)].instance
        d = view.decode[self._d % len(view.decode)].instance
        self._p, self._d = self._p + 1, self._d + 1
        return Decision(p, d)


class LeastLoadedPolicy(SchedulingPolicy):
    """Shortest predicted prefill queue (the paper's "load-balancing" baseline); ignores caches."""

    name = "least-loaded"

    def schedule(self, request: Request, view: ClusterView) -> Decision:
        """Prefill instance with the smallest ``queue_s``; least-loaded decode."""
        p = self.pick_min(view.prefill, lambda x: (x.queue_s, x.queued))
        return Decision(p.instance, self.least_loaded_decode(view).instance)


class PrefixPolicy(SchedulingPolicy):
    """Longest local prefix wins; ties go to the shortest queue.

    Matches shorter than ``prefix_min_blocks`` count as no match. Without that floor every
    conversation request (all share block 0) would follow the first instance that cached it.
    """

    name = "prefix"

    def schedule(self, request: Request, view: ClusterView) -> Decision:
        """Instance holding the longest prefix (device + own DRAM) of the request."""
        matches = view.match(request.hash_ids)
        floor = self.config.prefix_min_blocks

        def key(p: PrefillLoad) -> tuple[int, float]:
            got = matches[p.instance].cpu
            return (-(got if got >= floor else 0), p.queue_s)

        p = self.pick_min(view.prefill, key)
        got = matches[p.instance].cpu
        return Decision(p.instance, self.least_loaded_decode(view).instance,
                        prefix_blocks=got if got >= floor else 0)


class SglangPolicy(SchedulingPolicy):
    """SGLang router ``cache_aware``: imbalance guard, cache threshold, else smallest tree."""

    name = "sglang"

    def schedule(self, request: Request, view: ClusterView) -> Decision:
        """Shortest queue when imbalanced; best match above the threshold; else smallest cache."""
        c = self.config
        loads = [p.queued for p in view.prefill]
        hi, lo = max(loads), min(loads)
        decode = self.least_loaded_decode(view).instance
        if hi - lo > c.sglang_balance_abs and hi > c.sglang_balance_rel * lo:
            p = self.pick_min(view.prefill, lambda x: (x.queued, x.queue_s))
            return Decision(p.instance, decode)
        matches = view.match(request.hash_ids)
        best = max(m.gpu for m in matches.values())
        if request.hash_ids and best / len(request.hash_ids) > c.sglang_cache_threshold:
            p = self.pick_min(view.prefill, lambda x: (-matches[x.instance].gpu, x.queued))
            return Decision(p.instance, decode, prefix_blocks=best)
        p = self.pick_min(view.prefill, lambda x: (x.cached_blocks, x.queued))
        return Decision(p.instance, decode, prefix_blocks=matches[p.instance].gpu)


class LlmdPolicy(SchedulingPolicy):
    """llm-d EPP: weighted prefix (tier-weighted), queue and kv-usage scorers, max score wins."""

    name = "llmd"

    def scores(self, request: Request, view: ClusterView) -> dict[str, float]:
        """Combined score per prefill instance (exposed for tests)."""
        c = self.config
        w_prefix, w_queue, w_kv = c.llmd_weights
        w_gpu, w_cpu = c.llmd_tier_weights
        matches = view.match(request.hash_ids)
        blocks = max(1, len(request.hash_ids))
        queues = [p.queue_s for p in view.prefill]
        q_hi, q_lo = max(queues), min(queues)
        out = {}
        for p in view.prefill:
            m: Match = matches[p.instance]
            prefix = (w_gpu * m.gpu + w_cpu * (m.cpu - m.gpu)) / blocks
            queue = 1.0 if q_hi == q_lo else (q_hi - p.queue_s) / (q_hi - q_lo)
            kv = 1.0 - min(1.0, p.cached_blocks / max(1, p.gpu_capacity_blocks))
            out[p.instance] = w_prefix * prefix + w_queue * queue + w_kv * kv
        return out

    def schedule(self, request: Request, view: ClusterView) -> Decision:
        """Highest combined score; least-loaded decode."""
        s = self.scores(request, view)
        p = self.pick_min(view.prefill, lambda x: -s[x.instance])
        return Decision(p.instance, self.least_loaded_decode(view).instance)
