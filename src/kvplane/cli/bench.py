"""``kvplane bench ...``: benchmarks with progress, tables, ``--json`` and plots."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

bench_app = typer.Typer(help="Benchmarks that compare kvplane with its peer and the machine's limits.",
                        no_args_is_help=True)


def _ints(text: str) -> list[int]:
    from kvplane.common.config import parse_size

    return [parse_size(x) for x in text.split(",") if x]


def _fmt(v: float | None, unit: str = "") -> str:
    return "-" if v is None else f"{v:.2f}{unit}"


@bench_app.command("transfer")
def transfer(
    sizes: str = typer.Option("4KiB,64KiB,1MiB,16MiB,64MiB", help="Block sizes, comma separated."),
    batches: str = typer.Option("1,32", help="Requests per call (capped so a batch fits the buffer)."),
    ops: str = typer.Option("write,read", help="Directions."),
    buf_mb: int = typer.Option(512, help="Registered buffer per side, MiB."),
    duration: float = typer.Option(1.0, help="Seconds per cell."),
    impls: str = typer.Option("limits,kvplane-tcp,kvplane-shm,mooncake-tcp", help="Sides to measure."),
    mooncake_python: str = typer.Option(None, help="Python with mooncake installed (default /tmp/mc-venv/bin/python)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object per row instead of tables."),
    plot: str = typer.Option("transfer_bench.png", help="Where to write the GB/s-vs-block-size plot ('' for none)."),
) -> None:
    """Transfer engine: kvplane tcp and shm vs real Mooncake TCP vs raw socket and memcpy.

    Every side runs the same two-process loop; ratios are printed at the end.
    """
    from rich.progress import Progress, SpinnerColumn, TextColumn

    from kvplane.bench import transfer as tb

    opt = tb.Options(sizes=_ints(sizes), batches=[int(b) for b in batches.split(",")],
                     ops=ops.split(","), buf_mb=buf_mb, duration=duration,
                     mooncake_python=mooncake_python, impls=impls.split(","))
    console = Console(stderr=True)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), console=console,
                  disable=as_json) as prog:
        task = prog.add_task("starting", total=None)
        rows = tb.run(opt, progress=lambda s: prog.update(task, description=s))
    ratio_rows = tb.ratios(rows)
    if plot:
        tb.plot(rows, plot)
    if as_json:
        for r in rows:
            print(json.dumps(r))
        for r in ratio_rows:
            print(json.dumps({"ratio": True, **r}))
        return
    out = Console()
    t = Table(title="measured")
    for c in ("impl", "op", "size", "batch", "GB/s", "ops/s", "p50 us"):
        t.add_column(c)
    for r in rows:
        t.add_row(r["impl"], r["op"], str(r["size"]), str(r["batch"]), f"{r['gb_s']:.3f}",
                  f"{r['ops_s']:.0f}", _fmt(r.get("p50_us")))
    out.print(t)
    rt = Table(title="ratios (kvplane tcp / raw socket, / Mooncake tcp; shm / memcpy)")
    for c in ("op", "size", "batch", "tcp GB/s", "tcp/raw", "tcp/mooncake", "shm/memcpy"):
        rt.add_column(c)
    for r in ratio_rows:
        rt.add_row(r["op"], str(r["size"]), str(r["batch"]), f"{r['tcp_gb_s']:.3f}",
                   _fmt(r["tcp_vs_raw"]), _fmt(r["tcp_vs_mooncake"]), _fmt(r["shm_vs_memcpy"]))
    out.print(rt)
    if plot:
        out.print(f"plot written to {plot}")


def register(app: typer.Typer) -> None:
    """Add the ``bench`` group to the root app."""
    app.add_typer(bench_app, name="bench")
