"""Summaries of multi-turn runs: per-round hit rate and TTFT, the table, CSV/JSON, plots, trace.

Input is what :mod:`kvplane.bench.multiturn` recorded, one list of records per row (a row is one
cache setup, e.g. "L1" or "+kvplane L3"). Hit rate of a round = cached prompt tokens / prompt
tokens over the round's successful requests. Plots need matplotlib (the ``plots`` extra), imported
only when a plot is drawn. Imports only ``kvplane.common`` and ``kvplane.bench.multiturn``.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvplane.bench.multiturn import RequestRecord
from kvplane.common.errors import MissingExtra


@dataclass(frozen=True)
class RoundStats:
    """One round of one row.

    Attributes:
        round: 1-based turn.
        requests: requests sent in the round.
        failed: of those, how many failed.
        prompt_tokens: prompt tokens of the successful requests.
        cached_tokens: of those, served from a cache (None: the server reported none).
        hit_rate: cached / prompt tokens (None if unknown).
        ttft_p50_s: median TTFT.
        ttft_p90_s: 90th percentile TTFT.
        latency_p50_s: median end-to-end latency.
    """

    round: int
    requests: int
    failed: int
    prompt_tokens: int
    cached_tokens: int | None
    hit_rate: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    latency_p50_s: float | None


def quantile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (linear interpolation), None for no values."""
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1] \
        if 0 < q < 1 else (min(values) if q <= 0 else max(values))


def by_round(records: Sequence[RequestRecord]) -> list[RoundStats]:
    """Per-round statistics of one row's records."""
    out = []
    for rnd in sorted({r.round for r in records}):
        recs = [r for r in records if r.round == rnd]
        ok = [r for r in recs if not r.error]
        prompt = sum(r.prompt_tokens for r in ok)
        known = all(r.cached_tokens is not None for r in ok) and bool(ok)
        cached = sum(r.cached_tokens or 0 for r in ok) if known else None
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        lat = [r.latency_s for r in ok if r.latency_s is not None]
        out.append(RoundStats(rnd, len(recs), len(recs) - len(ok), prompt, cached,
                              cached / prompt if cached is not None and prompt else None,
                              quantile(ttft, 0.5), quantile(ttft, 0.9), quantile(lat, 0.5)))
    return out


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.0f}"


def table(rows: Mapping[str, Sequence[RoundStats]]) -> str:
    """The per-round table of every row (markdown), hit rate and TTFT p50/p90 in ms."""
    lines = ["| row | round | requests | failed | prompt tok | cached tok | hit rate | "
             "TTFT p50 ms | TTFT p90 ms | latency p50 ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, stats in rows.items():
        for s in stats:
            lines.append(f"| {name} | {s.round} | {s.requests} | {s.failed} | {s.prompt_tokens} | "
                         f"{'-' if s.cached_tokens is None else s.cached_tokens} | "
                         f"{_pct(s.hit_rate)} | {_ms(s.ttft_p50_s)} | {_ms(s.ttft_p90_s)} | "
                         f"{_ms(s.latency_p50_s)} |")
    return "\n".join(lines)


def compact_table(rows: Mapping[str, Sequence[RoundStats]]) -> str:
    """Rows × rounds: ``hit% / p50 ms`` per cell (markdown), the headline view."""
    rounds = sorted({s.round for stats in rows.values() for s in stats})
    lines = ["| row | " + " | ".join(f"r{r}" for r in rounds) + " |",
             "|---|" + "---:|" * len(rounds)]
    for name, stats in rows.items():
        cells = {s.round: f"{_pct(s.hit_rate)} / {_ms(s.ttft_p50_s)}" for s in stats}
        lines.append(f"| {name} | " + " | ".join(cells.get(r, "") for r in rounds) + " |")
    return "\n".join(lines)


def write_csv(rows: Mapping[str, Sequence[RequestRecord]], path: str | Path) -> Path:
    """Every request of every row, one CSV line each."""
    path = Path(path)
    fields = ["row", *RequestRecord(0, 0, 0).row()]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for name, recs in rows.items():
            for r in recs:
                w.writerow({"row": name, **r.row()})
    return path


def write_json(rows: Mapping[str, Sequence[RequestRecord]], path: str | Path,
               meta: Mapping[str, Any]) -> Path:
    """``meta`` plus, per row, its per-round statistics and its requests."""
    path = Path(path)
    doc = {**meta, "rows": {name: {"rounds": [asdict(s) for s in by_round(recs)],
                                   "requests": [r.row() for r in recs]}
                            for name, recs in rows.items()}}
    path.write_text(json.dumps(doc, indent=1), encoding="utf-8")
    return path


def trace_lines(records: Sequence[RequestRecord], t0: float = 0.0) -> list[str]:
    """The row's requests as a Mooncake-format trace (``kvplane simulate --trace``), by send time."""
    out = []
    for r in sorted(records, key=lambda r: r.start_s):
        out.append(json.dumps({"timestamp": int(round((r.start_s - t0) * 1000)),
                               "input_length": r.prompt_tokens, "output_length": r.output_tokens or 1,
                               "hash_ids": r.hash_ids, "round": r.round, "client": r.client}))
    return out


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise MissingExtra("plots need matplotlib: pip install 'kvplane[plots]'") from exc
    return plt


def plot_rounds(rows: Mapping[str, Sequence[RoundStats]], path: str | Path, title: str = "",
                predicted: Mapping[str, Mapping[int, float]] | None = None) -> Path:
    """Two panels: hit rate by round, TTFT p50 (solid) and p90 (dashed) by round, one line per row.

    ``predicted``: simulator hit rate by round per label, drawn dotted on the first panel.
    """
    plt = _pyplot()
    fig, (hit_ax, ttft_ax) = plt.subplots(1, 2, figsize=(13, 5))
    for i, (name, stats) in enumerate(rows.items()):
        color = f"C{i}"
        rnds = [s.round for s in stats]
        hit_ax.plot(rnds, [100 * (s.hit_rate or 0) for s in stats], "o-", color=color, label=name)
        ttft_ax.plot(rnds, [s.ttft_p50_s or float("nan") for s in stats], "o-", color=color,
                     label=name)
        ttft_ax.plot(rnds, [s.ttft_p90_s or float("nan") for s in stats], "--", color=color,
                     alpha=0.5)
    for j, (name, series) in enumerate((predicted or {}).items()):
        rnds = sorted(series)
        hit_ax.plot(rnds, [100 * series[r] for r in rnds], ":", color=f"C{len(rows) + j}",
                    label=name)
    hit_ax.set(xlabel="round", ylabel="prefix cache hit rate (%)", ylim=(0, 100),
               title="Hit rate by round")
    ttft_ax.set(xlabel="round", ylabel="TTFT (s, log scale)", yscale="log",
                title="TTFT by round (p50 solid, p90 dashed)")
    hit_ax.legend(fontsize=7)
    ttft_ax.legend(fontsize=7)
    for ax in (hit_ax, ttft_ax):
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, plt, path)


@dataclass(frozen=True)
class CrossoverPoint:
    """One working-set size of the crossover sweep, for one row.

    Attributes:
        row: cache setup.
        clients: concurrent conversations.
        working_set_mib: KV of every conversation's prompts after the last round.
        hit_rate: hit rate of the rounds after the first.
        ttft_p50_s: median TTFT of the rounds after the first.
    """

    row: str
    clients: int
    working_set_mib: float
    hit_rate: float | None
    ttft_p50_s: float | None


def crossover_point(row: str, clients: int, working_set_mib: float,
                    records: Sequence[RequestRecord]) -> CrossoverPoint:
    """Summarise one sweep run: the follow-up rounds (round >= 2) of ``records``."""
    later = [r for r in records if r.round >= 2 and not r.error]
    prompt = sum(r.prompt_tokens for r in later)
    cached = [r.cached_tokens for r in later]
    hit = (sum(c or 0 for c in cached) / prompt) if later and None not in cached and prompt else None
    ttft = [r.ttft_s for r in later if r.ttft_s is not None]
    return CrossoverPoint(row, clients, working_set_mib, hit, quantile(ttft, 0.5))


def plot_crossover(points: Sequence[CrossoverPoint], capacity_mib: float, path: str | Path,
                   title: str = "") -> Path:
    """Hit rate and TTFT p50 of follow-up rounds against working-set size, L2 capacity marked."""
    plt = _pyplot()
    fig, (hit_ax, ttft_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = list(dict.fromkeys(p.row for p in points))
    for i, name in enumerate(rows):
        pts = sorted((p for p in points if p.row == name), key=lambda p: p.working_set_mib)
        xs = [p.working_set_mib for p in pts]
        hit_ax.plot(xs, [100 * (p.hit_rate or 0) for p in pts], "o-", color=f"C{i}", label=name)
        ttft_ax.plot(xs, [p.ttft_p50_s or float("nan") for p in pts], "o-", color=f"C{i}",
                     label=name)
    for ax in (hit_ax, ttft_ax):
        ax.axvline(capacity_mib, color="grey", ls="--", label="L2 capacity")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax.set_xlabel("working set after the last round (MiB of KV)")
    hit_ax.set(ylabel="hit rate, rounds >= 2 (%)", ylim=(0, 100), title="Hit rate vs working set")
    ttft_ax.set(ylabel="TTFT p50, rounds >= 2 (s)", title="TTFT vs working set")
    ttft_ax.set_ylim(bottom=0)
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, plt, path)


def _save(fig: Any, plt: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def host_load() -> dict[str, Any]:
    """Date, load average and host CPU steal share since boot (/proc/stat), kept with numbers."""
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"),
                           "loadavg": [round(x, 2) for x in os.getloadavg()]}
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        out["steal_pct_since_boot"] = round(100 * fields[7] / sum(fields), 2)
    except (OSError, IndexError, ValueError):
        pass
    return out


def tables(rows: Mapping[str, Sequence[RequestRecord]]) -> str:
    """The per-round table of every row, then the compact rows x rounds table (markdown)."""
    stats = {name: by_round(recs) for name, recs in rows.items()}
    return table(stats) + "\n\n" + compact_table(stats)


def load_runs(paths: Sequence[str | Path]) -> list[dict[str, list[RequestRecord]]]:
    """The rows' records of each ``multiturn.json`` in ``paths`` (a file, or a directory
    holding one), in order."""
    runs = []
    for p in paths:
        p = Path(p)
        doc = json.loads((p / "multiturn.json" if p.is_dir() else p).read_text(encoding="utf-8"))
        runs.append({name: [RequestRecord(**r) for r in row["requests"]]
                     for name, row in doc["rows"].items()})
    return runs


def combined(runs: Sequence[Mapping[str, Sequence[RequestRecord]]],
             baseline: str = "+Mooncake L3") -> str:
    """Repeats of the same workload, per round: each row's hit rate and TTFT p50 over the
    requests of every run pooled, the median of the runs' own p50s with their range, and
    (when ``baseline`` is a row) each row's pooled p50 over the baseline's (markdown)."""
    names = list(dict.fromkeys(n for run in runs for n in run))
    pooled = {n: by_round([r for run in runs for r in run.get(n, ())]) for n in names}
    each = {n: [{s.round: s.ttft_p50_s for s in by_round(run[n])} for run in runs if n in run]
            for n in names}
    rounds = sorted({s.round for st in pooled.values() for s in st})
    head = "| row | runs | " + " | ".join(f"r{r}" for r in rounds) + " |"
    rule = "|---|---:|" + "---:|" * len(rounds)
    out = [f"Pooled over {len(runs)} runs: hit rate / TTFT p50 ms of all requests of the round",
           "", head, rule]
    for n in names:
        by_rnd = {s.round: f"{_pct(s.hit_rate)} / {_ms(s.ttft_p50_s)}" for s in pooled[n]}
        out.append(f"| {n} | {len(each[n])} | " + " | ".join(by_rnd.get(r, "") for r in rounds)
                   + " |")
    out += ["", "Median of the runs' TTFT p50 ms (lowest-highest run)", "", head, rule]
    for n in names:
        cells = []
        for r in rounds:
            vals = sorted(v for run in each[n] if (v := run.get(r)) is not None)
            cells.append(f"{_ms(statistics.median(vals))} ({_ms(vals[0])}-{_ms(vals[-1])})"
                         if vals else "")
        out.append(f"| {n} | {len(each[n])} | " + " | ".join(cells) + " |")
    if baseline in pooled:
        base = {s.round: s.ttft_p50_s for s in pooled[baseline]}
        out += ["", f"Pooled TTFT p50 over {baseline}'s", "", head, rule]
        for n in names:
            if n == baseline:
                continue
            mine = {s.round: s.ttft_p50_s for s in pooled[n]}
            cells = [f"{v / b:.2f}" if (v := mine.get(r)) is not None and (b := base.get(r))
                     else "-" for r in rounds]  # (by round: a row may lack one)
            out.append(f"| {n} | {len(each[n])} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def emit(rows: Mapping[str, Sequence[RequestRecord]], out: str | Path, meta: Mapping[str, Any],
         predicted: Mapping[str, Mapping[int, float]] | None = None, plots: bool = True) -> list[Path]:
    """Write ``multiturn.json``, ``multiturn.csv`` and ``multiturn_rounds.png`` into ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stats = {name: by_round(recs) for name, recs in rows.items()}
    paths = [write_json(rows, out / "multiturn.json", {**meta, "predicted": predicted or {}}),
             write_csv(rows, out / "multiturn.csv")]
    if plots and stats:
        c = meta.get("config", {})
        title = (f"{c.get('clients')} conversations x {c.get('rounds')} rounds, "
                 f"{c.get('request_length')}-token questions, {c.get('output_length')}-token answers"
                 + (f"; {meta['model']}" if meta.get("model") else ""))
        paths.append(plot_rounds(stats, out / "multiturn_rounds.png", title, predicted))
    return paths
