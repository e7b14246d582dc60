"""Experiments over a trace: policies × loads, effective capacity, hit ratio by turn per cache setup.

The CLI is a thin layer over this module. No printing; progress goes through a callback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvplane.common.errors import InvalidArgument
from kvplane.conductor.scheduling.config import SimConfig
from kvplane.conductor.scheduling.outcomes import Outcome, capacity, summarize
from kvplane.conductor.scheduling.simulator import SimResult, Simulator
from kvplane.conductor.scheduling.trace import turns
from kvplane.conductor.scheduling.view import Request

Progress = Callable[[str, int, int], None]


@dataclass
class PolicyReport:
    """Everything measured for one policy.

    Attributes:
        policy: policy name.
        by_load: load multiplier -> summary row (see :func:`metrics.summarize`).
        capacity: TBT threshold label -> highest sustained load (None: not even the lowest).
        ttfts: TTFTs of served requests at the first load (for the CDF).
        transfers: prefix pulls at the first load.
        index_calls: prefix-index matches at the first load.
        seed: the seed of every random choice in these runs.
    """

    policy: str
    by_load: dict[float, dict[str, object]]
    capacity: dict[str, float | None]
    ttfts: list[float]
    transfers: int
    index_calls: int
    seed: int = 0

    def row(self) -> dict[str, object]:
        """The JSON object of this policy: the first load's summary plus capacity and per-load rows."""
        first = next(iter(self.by_load))
        return {"policy": self.policy, "load": first, "seed": self.seed, **self.by_load[first],
                "transfers": self.transfers, "index_calls": self.index_calls,
                "capacity": self.capacity,
                "by_load": [{"load": k, **v} for k, v in self.by_load.items()]}


def scaled(requests: Sequence[Request], load: float) -> list[Request]:
    """The same requests arriving ``load`` times faster."""
    if load == 1.0:
        return list(requests)
    return [replace(r, arrival_s=r.arrival_s / load) for r in requests]


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """Split ``name@knob=value@knob=value`` into the registry name and ``policy.*`` overrides.

    Example: ``mooncake@rejection=none@balancing_threshold=2``.

    Raises:
        InvalidArgument: a part after ``@`` is not ``knob=value``.
    """
    name, *parts = spec.split("@")
    overrides = {}
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq or not key:
            raise InvalidArgument(f"bad policy option {part!r} in {spec!r}; use name@knob=value")
        overrides[f"policy.{key}"] = value
    return name, overrides


def run_policy(requests: Sequence[Request], config: SimConfig, policy: str, load: float,
               progress: Progress | None = None) -> SimResult:
    """One simulation of ``policy`` (a name or ``name@knob=value`` spec) at ``load``.

    Arrivals of ``requests`` are at load 1; they are scaled here.
    """
    name, overrides = parse_spec(policy)
    cfg = replace(config.with_overrides(overrides), cluster=replace(config.cluster, load=load))
    label = f"{policy} ×{load:g}"
    cb = None if progress is None else (lambda done, total: progress(label, done, total))
    res = Simulator(cfg, name).run(scaled(requests, load), cb)
    res.policy = policy
    return res


def compare(requests: Sequence[Request], config: SimConfig, policies: Sequence[str],
            loads: Sequence[float], progress: Progress | None = None) -> list[PolicyReport]:
    """Run every policy at every load (ascending loads; the first is the reporting load)."""
    if not loads or not policies:
        raise InvalidArgument("need at least one policy and one load")
    out = []
    for policy in policies:
        by_load: dict[float, dict[str, object]] = {}
        results = [run_policy(requests, config, policy, load, progress) for load in loads]
        for load, res in zip(loads, results):
            by_load[load] = summarize(res.outcomes, config.slo)
        first = results[0]
        att = {ld: row["slo_attainment_by_tbt"] for ld, row in by_load.items()}
        out.append(PolicyReport(policy, by_load, capacity(att, config.slo),  # type: ignore[arg-type]  # dict of floats
                                [o.ttft_s for o in first.outcomes if o.ttft_s is not None and not o.rejected],
                                first.transfers, first.index_calls, config.seed))
    return out


def hit_ratio_by_turn(requests: Sequence[Request], outcomes: Sequence[Outcome], block_tokens: int = 512,
                      max_turn: int = 10) -> dict[int, float]:
    """Block-weighted prefix hit ratio per inferred turn (turns >= ``max_turn`` folded together)."""
    turn = turns(requests, block_tokens)
    hit: dict[int, int] = {}
    tot: dict[int, int] = {}
    for o in outcomes:
        if o.rejected is not None or o.ttft_s is None:
            continue
        t = min(turn.get(o.rid, 1), max_turn)
        hit[t] = hit.get(t, 0) + sum(o.hits)
        tot[t] = tot.get(t, 0) + o.blocks
    return {t: hit[t] / tot[t] for t in sorted(tot) if tot[t]}


def tier_setups(config: SimConfig, pool_blocks: int) -> dict[str, SimConfig]:
    """GPU only, GPU + local DRAM, GPU + DRAM + shared pool (HiCache's multi-turn figure)."""
    cl = config.cluster
    return {
        "GPU only": replace(config, cluster=replace(cl, cpu_cache_blocks=0, pool_blocks=0)),
        "GPU + CPU": replace(config, cluster=replace(cl, pool_blocks=0)),
        "GPU + CPU + pool": replace(config, cluster=replace(cl, pool_blocks=pool_blocks)),
    }


def tier_series(requests: Sequence[Request], config: SimConfig, policy: str, pool_blocks: int,
                progress: Progress | None = None) -> dict[str, dict[int, float]]:
    """Hit ratio by turn for each cache setup of :func:`tier_setups`, at load 1."""
    out = {}
    for label, cfg in tier_setups(config, pool_blocks).items():
        cb = None if progress is None else (lambda d, t, lb=label: progress(f"{policy} {lb}", d, t))
        name, overrides = parse_spec(policy)
        res = Simulator(cfg.with_overrides(overrides), name).run(requests, cb)
        out[label] = hit_ratio_by_turn(requests, res.outcomes, cfg.cluster.block_tokens)
    return out
