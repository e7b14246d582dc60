"""Per-request outcomes and what is reported from them: TTFT, TBT, SLO attainment, capacity, hits.

Definitions (FAST'25 §5): TBT of a request is the mean of its longest 10 % of inter-token gaps; an
*effective* request has TTFT <= 30 s and TBT <= the threshold (100/200/300 ms); a rejected request
is never effective. *Effective request capacity* (issue 5) is the highest load multiplier at which at
least 90 % of requests are effective. Pure; must not import the simulator.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvplane.conductor.scheduling.config import SloConfig

HIT_TIERS = ("gpu", "cpu", "remote", "pool")


@dataclass(slots=True)
class Outcome:
    """What happened to one request.

    Attributes:
        rid: request id.
        arrival_s: arrival time.
        blocks: prompt blocks.
        rejected: rejection reason or None.
        prefill: prefill instance (None if rejected).
        decode: decode instance (None if rejected).
        ttft_s: time to first token (None if rejected).
        tbt_s: TBT as defined above (0.0 for outputs of one token; None if rejected).
        finish_s: time of the last token (None if rejected).
        hits: blocks reused per tier, in :data:`HIT_TIERS` order (device, own DRAM, pulled from
            another instance, shared pool).
    """

    rid: int
    arrival_s: float
    blocks: int
    rejected: str | None = None
    prefill: str | None = None
    decode: str | None = None
    ttft_s: float | None = None
    tbt_s: float | None = None
    finish_s: float | None = None
    hits: tuple[int, int, int, int] = (0, 0, 0, 0)


def tbt(gaps: Sequence[tuple[float, float]], first_extra: float = 0.0) -> float:
    """Mean of the longest 10 % of inter-token gaps.

    Args:
        gaps: (gap seconds, how many consecutive gaps of that length); counts may be fractional
            (the simulator advances decode in continuous time).
        first_extra: extra wait before the very first decode token (queueing for decode KV),
            added to the first gap.

    Returns:
        The TBT in seconds (0.0 when there are no gaps).
    """
    items = [(s, c) for s, c in gaps if c > 0]
    if first_extra > 0 and items:
        s, c = items[0]
        items[0] = (s, c - 1.0) if c > 1.0 else (s, 0.0)
        items.append((s + first_extra, 1.0))
    total = sum(c for _, c in items)
    if total <= 0:
        return 0.0
    want = max(1.0, math.ceil(0.1 * total - 1e-9))
    want = min(want, total)
    acc = taken = 0.0
    for s, c in sorted(items, key=lambda x: -x[0]):
        take = min(c, want - taken)
        acc += s * take
        taken += take
        if taken >= want - 1e-12:
            break
    return acc / taken


def effective(o: Outcome, slo: SloConfig, tbt_limit: float) -> bool:
    """True if the request was served within TTFT and TBT bounds."""
    return (o.rejected is None and o.ttft_s is not None and o.ttft_s <= slo.ttft_s
            and o.tbt_s is not None and o.tbt_s <= tbt_limit)


def summarize(outcomes: Sequence[Outcome], slo: SloConfig) -> dict[str, object]:
    """The report row of one run (TTFT/TBT over served requests; attainment over all).

    Returns:
        ``requests``, ``served``, ``rejected``, ``ttft_mean_s/p50/p90/p99``, ``tbt_mean_s``,
        ``tbt_p90_s``, ``slo_attainment`` (at the loosest TBT threshold) and
        ``slo_attainment_by_tbt``, ``hit_ratio`` and ``hit_ratio_by_tier``.
    """
    served = [o for o in outcomes if o.rejected is None and o.ttft_s is not None]
    ttft = np.array([o.ttft_s for o in served], dtype=float)
    tbts = np.array([o.tbt_s for o in served if o.tbt_s is not None], dtype=float)
    n = len(outcomes)
    by_tbt = {f"{t * 1000:.0f}ms": (sum(effective(o, slo, t) for o in outcomes) / n if n else 0.0)
              for t in slo.tbt_thresholds_s}
    blocks = sum(o.blocks for o in served)
    tiers = [sum(o.hits[i] for o in served) for i in range(len(HIT_TIERS))]

    def stat(a: np.ndarray, f: str, q: float = 0.0) -> float | None:
        if not len(a):
            return None
        return float(np.mean(a)) if f == "mean" else float(np.percentile(a, q))

    return {
        "requests": n,
        "served": len(served),
        "rejected": n - len(served),
        "ttft_mean_s": stat(ttft, "mean"),
        "ttft_p50_s": stat(ttft, "p", 50),
        "ttft_p90_s": stat(ttft, "p", 90),
        "ttft_p99_s": stat(ttft, "p", 99),
        "tbt_mean_s": stat(tbts, "mean"),
        "tbt_p90_s": stat(tbts, "p", 90),
        "slo_attainment": by_tbt[f"{max(slo.tbt_thresholds_s) * 1000:.0f}ms"] if by_tbt else None,
        "slo_attainment_by_tbt": by_tbt,
        "hit_ratio": (sum(tiers) / blocks) if blocks else 0.0,
        "hit_ratio_by_tier": {t: (v / blocks if blocks else 0.0) for t, v in zip(HIT_TIERS, tiers)},
    }


def capacity(attainment_by_load: Mapping[float, Mapping[str, float]],
             slo: SloConfig) -> dict[str, float | None]:
    """Effective request capacity per TBT threshold.

    Args:
        attainment_by_load: load multiplier -> ``slo_attainment_by_tbt`` of the run at that load.
        slo: the attainment target.

    Returns:
        threshold label -> highest load meeting the target (None if none of the loads does).
        Loads above the first failing one do not count (capacity is where service breaks down).
    """
    out: dict[str, float | None] = {}
    labels = {k for row in attainment_by_load.values() for k in row}
    for label in sorted(labels):
        best = None
        for load in sorted(attainment_by_load):
            if attainment_by_load[load].get(label, 0.0) >= slo.attainment:
                best = load
            else:
                break
        out[label] = best
    return out
