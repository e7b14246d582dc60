"""Cache-aware prefill/decode scheduling: policies behind one seam, a trace-driven simulator, metrics.

Modules: ``config`` (every constant and its source), ``timemodel`` (prefill/transfer/decode-step
times), ``view`` (what a policy sees and returns), ``prefix`` (adapters to the conductor's prefix
index), ``policy`` (the seam + registry), ``baselines`` and ``mooncake`` (the policies), ``cache``
(simulated LRU tiers), ``trace`` (the Mooncake trace format), ``simulator``, ``metrics``,
``report`` (policies × loads, capacity, hit ratio by turn), ``router`` (the live router over a
running conductor), ``plots`` (PNG output; imports matplotlib lazily). Importing this package
imports neither the simulator nor matplotlib.
"""

from kvplane.conductor.scheduling.config import ClusterConfig, ModelConfig, PolicyConfig, SimConfig, SloConfig
from kvplane.conductor.scheduling.policy import POLICIES, SchedulingPolicy, create_policy
from kvplane.conductor.scheduling.timemodel import TimeModel
from kvplane.conductor.scheduling.view import (
                                                 ClusterView,
                                                 Decision,
                                                 DecodeLoad,
                                                 PrefillLoad,
                                                 PrefixSource,
                                                 Request,
)

__all__ = [
    "POLICIES", "ClusterConfig", "ClusterView", "Decision", "DecodeLoad", "ModelConfig",
    "PolicyConfig", "PrefillLoad", "PrefixSource", "Request", "SchedulingPolicy", "SimConfig",
    "SloConfig", "TimeModel", "create_policy",
]
