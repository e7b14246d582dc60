"""The scheduling seam: one ABC, one registry, one factory. Shared by simulator and live router.

Built-in policies are registered here by name and imported only when chosen. Must not import
the simulator, the router or any policy module at import time.
"""

from __future__ import annotations

import logging
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TypeVar

from kvplane.common.registry import Registry
from kvplane.conductor.scheduling.config import PolicyConfig
from kvplane.conductor.scheduling.timemodel import TimeModel
from kvplane.conductor.scheduling.view import ClusterView, Decision, DecodeLoad, Request

log = logging.getLogger(__name__)
L = TypeVar("L")


class SchedulingPolicy(ABC):
    """Chooses a (prefill, decode) pair for a request, or rejects it.

    Contract: :meth:`schedule` does not block, does no I/O, does not mutate the view, and is
    called from one thread at a time (the simulator loop or the router's request handler). All
    randomness comes from ``self.rng``, seeded at construction, so a run is reproducible.

    Args:
        config: policy knobs.
        time_model: prefill/transfer/decode-step estimators (the same ones the simulator runs).
        seed: seed of this policy's random choices.
    """

    name = "base"

    def __init__(self, config: PolicyConfig, time_model: TimeModel, seed: int = 0) -> None:
        self.config, self.time_model, self.seed = config, time_model, seed
        self.rng = random.Random(seed)

    @abstractmethod
    def schedule(self, request: Request, view: ClusterView) -> Decision:
        """Decide for one request.

        Args:
            request: the request (``output_length`` must not be used as an oracle).
            view: the cluster snapshot.

        Returns:
            The decision; ``Decision.reject`` set when the request is refused.
        """

    # helpers shared by the built-ins ---------------------------------------------------------
    def pick_min(self, items: Sequence[L], key: object) -> L:
        """Item with the smallest ``key(item)``; ties broken by the seeded RNG."""
        keyed = [(key(x), x) for x in items]  # type: ignore[operator]  # key is a callable
        low = min(k for k, _ in keyed)
        ties = [x for k, x in keyed if k == low]
        return ties[0] if len(ties) == 1 else self.rng.choice(ties)

    def least_loaded_decode(self, view: ClusterView) -> DecodeLoad:
        """Decode instance with the fewest KV tokens committed (running, waiting and incoming)."""
        return self.pick_min(view.decode, lambda d: (d.kv_tokens + _incoming_kv(d), d.running))


def _incoming_kv(d: DecodeLoad) -> int:
    return sum(kv for _, kv in d.incoming.values())


POLICIES: Registry[SchedulingPolicy] = Registry("scheduling policy")
for _name, _path in [
    ("random", "kvplane.conductor.scheduling.baselines:RandomPolicy"),
    ("round-robin", "kvplane.conductor.scheduling.baselines:RoundRobinPolicy"),
    ("least-loaded", "kvplane.conductor.scheduling.baselines:LeastLoadedPolicy"),
    ("prefix", "kvplane.conductor.scheduling.baselines:PrefixPolicy"),
    ("sglang", "kvplane.conductor.scheduling.baselines:SglangPolicy"),
    ("llmd", "kvplane.conductor.scheduling.baselines:LlmdPolicy"),
    ("mooncake", "kvplane.conductor.scheduling.kvcentric:KVCentricPolicy"),
    ("mooncake-local", "kvplane.conductor.scheduling.kvcentric:KVCentricLocalPolicy"),
]:
    POLICIES.register(_name, _path)


def create_policy(name: str, config: PolicyConfig, time_model: TimeModel, seed: int = 0) -> SchedulingPolicy:
    """Build a policy by registry name (or ``module:Class``) and log its seed.

    Raises:
        InvalidArgument: unknown name (the message lists the valid ones).
    """
    cls = POLICIES.load(name)
    log.info("scheduling policy %s seed=%d", name, seed)
    return cls(config, time_model, seed)
