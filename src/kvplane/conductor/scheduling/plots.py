"""PNG plots of simulation results: TTFT CDF, capacity per TBT threshold, hit ratio by turn.

Imports matplotlib (Agg backend, extra ``plots``) lazily inside each function so the rest of the
package stays light. Writes files only where told. Must not import the simulator.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvplane.common.extras import pyplot


def _pyplot() -> Any:
    return pyplot()


def ttft_cdf(ttfts: Mapping[str, Sequence[float]], path: str | Path, title: str = "") -> Path:
    """CDF of TTFT per policy (log x axis).

    Args:
        ttfts: policy -> TTFTs of its served requests, in seconds.
        path: output PNG.
        title: plot title.
    """
    import numpy as np

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for name, vals in ttfts.items():
        if not len(vals):
            continue
        xs = np.sort(np.asarray(vals, dtype=float))
        ys = np.arange(1, len(xs) + 1) / len(xs)
        ax.plot(np.maximum(xs, 1e-3), ys, label=f"{name} (mean {xs.mean():.2f} s)")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of served requests")
    ax.axvline(30.0, color="grey", linestyle=":", linewidth=1)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title or "TTFT CDF")
    return _save(fig, plt, path)


def capacity_bars(capacity: Mapping[str, Mapping[str, float | None]], path: str | Path,
                  title: str = "") -> Path:
    """Effective request capacity (highest sustained load multiplier) per policy and TBT threshold.

    Args:
        capacity: policy -> {threshold label -> load or None (none of the loads sustained)}.
        path: output PNG.
        title: plot title.
    """
    plt = _pyplot()
    policies = list(capacity)
    labels = sorted({k for row in capacity.values() for k in row}, key=lambda s: float(s.rstrip("ms")))
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    width = 0.8 / max(1, len(labels))
    for j, label in enumerate(labels):
        vals = [capacity[p].get(label) or 0.0 for p in policies]
        xs = [i + (j - (len(labels) - 1) / 2) * width for i in range(len(policies))]
        ax.bar(xs, vals, width=width, label=f"TBT ≤ {label}")
        for x, p in zip(xs, policies):
            if capacity[p].get(label) is None:  # not even the lowest load was sustained
                ax.text(x, 0.02, "none", rotation=90, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(policies)))
    ax.set_xticklabels(policies, rotation=20, fontsize=8)
    ax.set_ylabel("max load × with ≥ 90 % effective")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "Effective request capacity")
    return _save(fig, plt, path)


def hit_by_turn(series: Mapping[str, Mapping[int, float]], path: str | Path, title: str = "",
                max_turn: int = 10) -> Path:
    """Prefix hit ratio by conversation turn, one line per cache configuration.

    Args:
        series: configuration label -> {turn -> hit ratio}.
        path: output PNG.
        title: plot title.
        max_turn: turns beyond this are folded into the last point.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for label, by_turn in series.items():
        turns = sorted(t for t in by_turn if t <= max_turn)
        ax.plot(turns, [by_turn[t] for t in turns], marker="o", label=label)
    ax.set_xlabel(f"conversation turn (inferred from hash chains; last point = {max_turn}+)")
    ax.set_ylabel("prefix hit ratio (blocks)")
    ax.set_ylim(0, 1)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "Hit ratio by turn")
    return _save(fig, plt, path)


def _save(fig: Any, plt: Any, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
