"""``kvplane simulate``: replay a Mooncake-format trace under scheduling policies; table, JSON, plots."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.table import Table

from kvplane.data import SAMPLE_TRACE

if TYPE_CHECKING:
    from kvplane.conductor.scheduling.config import SimConfig
    from kvplane.conductor.scheduling.report import PolicyReport
    from kvplane.conductor.scheduling.view import Request

log = logging.getLogger(__name__)
DEFAULT_POLICIES = "random,round-robin,least-loaded,prefix,sglang,llmd,mooncake-local,mooncake"


def _floats(text: str) -> list[float]:
    try:
        return sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError as exc:
        raise typer.BadParameter(f"not a list of numbers: {text!r}") from exc


def _fmt(v: object, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}{unit}" if unit != "%" else f"{100 * v:.1f}%"
    return str(v)


def simulate(
    trace: str = typer.Option(str(SAMPLE_TRACE), "--trace", show_default="the bundled sample",
                              help="Trace file (Mooncake JSONL: timestamp ms, input_length, "
                              "output_length, hash_ids of 512-token blocks). The default is a "
                              "1,000-request slice of Mooncake's conversation trace; the full "
                              "traces are in github.com/kvcache-ai/Mooncake, FAST25-release/traces."),
    policy: str = typer.Option(DEFAULT_POLICIES, "--policy", help="Policies, comma separated; a "
                               "policy may carry knobs: mooncake@rejection=none@balancing_threshold=2."),
    loads: str = typer.Option("1", help="Load multipliers (arrival rate ×), comma separated; the "
                              "lowest is reported, all are used for effective capacity."),
    prefill: int = typer.Option(8, help="Prefill instances (X)."),
    decode: int = typer.Option(8, help="Decode instances (Y)."),
    gpu_blocks: int = typer.Option(1000, help="GPU prefix cache per prefill instance, blocks."),
    cpu_blocks: int = typer.Option(5860, help="Local DRAM cache per prefill instance, blocks (0 = none)."),
    pool_blocks: int = typer.Option(0, help="Shared pool capacity, blocks (0 = no pool)."),
    pool_gbps: float = typer.Option(87.0, help="Shared pool bandwidth, GB/s."),
    limit: int = typer.Option(None, help="Use only the first N requests of the trace."),
    seed: int = typer.Option(0, help="Seed of every random choice (logged)."),
    settings: list[str] = typer.Option([], "--set", help="Override any config field, e.g. "
                                       "policy.rejection=none or model.mfu=0.4 (repeatable)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object per policy."),
    plots: str = typer.Option(".", help="Directory for the PNG plots ('' for none)."),
    plot_prefix: str = typer.Option("", help="Prefix of the PNG file names (e.g. 'scheduling_')."),
    tiers: bool = typer.Option(True, "--tiers/--no-tiers", help="Also run GPU-only / +CPU / +pool "
                               "for the hit-ratio-by-turn plot."),
    tier_policy: str = typer.Option("mooncake-local", help="Policy for the tier runs (default: cache-aware "
                                    "without remote pulls, so the pool is its only global cache)."),
    tier_pool_blocks: int = typer.Option(0, help="Pool size for the '+pool' tier run (0 = "
                                         "prefill × cpu_blocks, the sum of all local DRAM)."),
) -> None:
    """Replay a trace through a simulated prefill/decode cluster and compare routing policies.

    Reports TTFT (mean/p50/p90/p99), TBT (mean of the longest 10 % of gaps), SLO attainment,
    rejections, hit ratio per tier and, over the given loads, effective request capacity.
    Writes ttft_cdf.png, capacity.png and hit_by_turn.png (with --plot-prefix) into --plots.
    """
    from kvplane.cli import plots as optional
    from kvplane.conductor.scheduling import report

    names = [p.strip() for p in policy.split(",") if p.strip()]
    load_list = _floats(loads)
    no_plots = optional.missing() if plots else None
    with_tiers = bool(tiers and plots and (no_plots is None or as_json))
    cfg, requests = _setup(trace, names + ([tier_policy] if with_tiers else []), settings, limit, seed,
                           prefill=prefill, decode=decode, gpu_blocks=gpu_blocks,
                           cpu_blocks=cpu_blocks, pool_blocks=pool_blocks, pool_gbps=pool_gbps)
    log.info("simulate trace=%s requests=%d policies=%s loads=%s seed=%d", trace, len(requests),
             names, load_list, seed)
    runs = len(names) * len(load_list) + (3 if with_tiers else 0)
    with _progress(runs * len(requests), disable=as_json) as progress:
        reports = report.compare(requests, cfg, names, load_list, progress)
        series = {}
        if with_tiers:
            pool = tier_pool_blocks or cfg.cluster.prefill_instances * cfg.cluster.cpu_cache_blocks
            series = report.tier_series(requests, cfg, tier_policy, pool, progress)
    if as_json:
        for r in reports:
            print(json.dumps(r.row()))
        if series:
            print(json.dumps({"hit_ratio_by_turn": {k: {str(t): v for t, v in s.items()}
                                                    for k, s in series.items()}, "policy": tier_policy}))
    else:
        _table(reports, load_list)
    if no_plots is not None:
        optional.skipped("kvplane simulate", no_plots)
    elif plots:
        _plots(reports, series, load_list, f"{plots}/{plot_prefix}", f"{prefill}P+{decode}D", tier_policy)


def _setup(trace: str, specs: list[str], settings: list[str], limit: int | None, seed: int,
           **cluster: Any) -> tuple[SimConfig, list[Request]]:
    """Validate policy specs, build the config, read the trace; bad input becomes BadParameter."""
    from kvplane.common.errors import KVPlaneError
    from kvplane.conductor.scheduling import report
    from kvplane.conductor.scheduling.config import ClusterConfig, SimConfig
    from kvplane.conductor.scheduling.policy import POLICIES
    from kvplane.conductor.scheduling.trace import load_trace

    try:
        for spec in specs:
            name, knobs = report.parse_spec(spec)
            POLICIES.load(name)
            SimConfig().with_overrides(knobs)
        cl = ClusterConfig(prefill_instances=cluster["prefill"], decode_instances=cluster["decode"],
                           gpu_cache_blocks=cluster["gpu_blocks"], cpu_cache_blocks=cluster["cpu_blocks"],
                           pool_blocks=cluster["pool_blocks"], pool_bytes_per_s=cluster["pool_gbps"] * 1e9)
        cfg = SimConfig(cluster=cl, seed=seed).with_overrides(
            dict(s.split("=", 1) for s in settings if "=" in s))
        return cfg, load_trace(trace, limit=limit)
    except KVPlaneError as exc:
        raise typer.BadParameter(str(exc)) from exc


@contextmanager
def _progress(total: int, disable: bool) -> Iterator[Callable[[str, int, int], None]]:
    """A rich progress bar on stderr over all runs; yields the callback the runs report to."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True), disable=disable) as prog:
        task = prog.add_task("simulating", total=total)
        base, current = [0], [""]

        def progress(label: str, done: int, total: int) -> None:
            if label != current[0]:
                base[0] += total if current[0] else 0  # every run replays the same requests
                current[0] = label
            prog.update(task, completed=base[0] + done, description=label)

        yield progress


def _plots(reports: list[PolicyReport], series: dict[str, dict[int, float]], loads: list[float],
           prefix: str, cluster: str, tier_policy: str) -> None:
    from kvplane.conductor.scheduling import plots

    plots.ttft_cdf({r.policy: r.ttfts for r in reports}, f"{prefix}ttft_cdf.png",
               f"TTFT CDF, load ×{loads[0]:g}, {cluster}")
    plots.capacity_bars({r.policy: r.capacity for r in reports}, f"{prefix}capacity.png",
                    f"Effective capacity ({len(loads)} loads, ×{loads[0]:g}–×{loads[-1]:g})")
    if series:
        plots.hit_by_turn(series, f"{prefix}hit_by_turn.png", f"Hit ratio by turn ({tier_policy})")


def _table(reports: list[PolicyReport], loads: list[float]) -> None:
    out = Console()
    out = Console(width=max(out.width, 150))  # keep columns readable when piped
    t = Table(title=f"load ×{loads[0]:g}")
    for col in ("policy", "served", "rejected", "TTFT mean", "p50", "p90", "p99", "TBT mean",
                "SLO (300ms)", "hit", "capacity 100/200/300ms"):
        t.add_column(col, justify="right")
    for r in reports:
        row = r.by_load[loads[0]]
        cap = "/".join(_fmt(r.capacity.get(k)) for k in sorted(r.capacity, key=lambda s: float(s[:-2])))
        t.add_row(r.policy, _fmt(row["served"]), _fmt(row["rejected"]), _fmt(row["ttft_mean_s"], "s"),
                  _fmt(row["ttft_p50_s"], "s"), _fmt(row["ttft_p90_s"], "s"), _fmt(row["ttft_p99_s"], "s"),
                  _fmt(row["tbt_mean_s"], "s"), _fmt(row["slo_attainment"], "%"),
                  _fmt(row["hit_ratio"], "%"), cap)
    out.print(t)


def register(app: typer.Typer) -> None:
    """Add ``simulate`` to the ``kvplane`` app."""
    app.command("simulate")(simulate)
