"""``kvplane bench ...``: benchmarks with progress, tables, ``--json`` and plots."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import typer
from rich.table import Table

from kvplane.cli.lifecycle import size_option

bench_app = typer.Typer(help="Benchmarks that compare kvplane with its peer and the machine's limits.",
                        no_args_is_help=True)


def _counts(text: str, option: str) -> list[int]:
    """Comma-separated positive integers (batches, client counts); else a usage error."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise typer.BadParameter(f"{text!r}: expected positive integers, comma separated",
                                 param_hint=option)
    return out


MOONCAKE_HELP = ("Python with real Mooncake installed (default: KVPLANE_MOONCAKE_PYTHON, this "
                 "interpreter if it imports mooncake, then /tmp/mc-venv/bin/python).")


def _ints(text: str) -> list[int]:
    """Comma-separated sizes; a bad one is a usage error (exit 2)."""
    from kvplane.common.config import parse_size
    from kvplane.common.errors import InvalidArgument

    try:
        return [parse_size(x) for x in text.split(",") if x]
    except InvalidArgument as exc:
        raise typer.BadParameter(str(exc)) from exc


def _measure(bench: Any, opt: Any, as_json: bool,
             merge: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]) -> Measured:
    """Run a bench core (``run``/``steps``/``ratios``) with a progress bar (or a line per step)
    on stderr and a line per skipped side; Ctrl-C keeps what was measured (``merge`` turns the
    rows so far into the result rows). Prints the JSON rows when asked."""
    from kvplane.bench.report import Steps

    sink: list[dict[str, Any]] = []
    with Steps(bench.steps(opt), quiet=as_json) as steps:
        try:
            rows = bench.run(opt, progress=steps, sink=sink)
            steps.finish()
            stopped = False
        except KeyboardInterrupt:
            rows, stopped = merge(sink), True
    if stopped:
        steps.console.print(steps.interrupted(), markup=False, highlight=False)
    ratio_rows = bench.ratios(rows)
    if as_json:
        for r in rows:
            print(json.dumps(r))
        for r in ratio_rows:
            print(json.dumps({"ratio": True, **r}))
    return Measured(rows, ratio_rows, stopped)


@dataclass(frozen=True)
class Measured:
    """A bench run's rows, its ratios, and whether Ctrl-C cut it short."""

    rows: list[dict[str, Any]]
    ratios: list[dict[str, Any]]
    interrupted: bool


def _finish(got: Measured, command: str, plot: Callable[[], object], path: str) -> None:
    """After the tables: the plot (or the line saying it was skipped), then exit 130 if Ctrl-C
    ended the run."""
    from kvplane.cli import plots

    if path and not got.interrupted:
        plots.draw(command, plot, f"plot written to {path}")
    if got.interrupted:
        raise typer.Exit(130)


def _fmt(v: float | None, unit: str = "") -> str:
    return "-" if v is None else f"{v:.2f}{unit}"


@bench_app.command("transfer")
def transfer(
    sizes: str = typer.Option("4KiB,64KiB,1MiB,16MiB,64MiB", help="Block sizes, comma separated."),
    batches: str = typer.Option("1,32", help="Requests per call (capped so a batch fits the buffer)."),
    ops: str = typer.Option("write,read", help="Directions."),
    buf_mb: int = typer.Option(512, min=1, help="Registered buffer per side, MiB."),
    duration: float = typer.Option(1.0, min=0.01, help="Seconds per cell."),
    impls: str = typer.Option("limits,kvplane-tcp,kvplane-shm,mooncake-tcp,kvplane-nixl,nixl-raw",
                              help="Sides to measure. NIXL sides: kvplane-nixl, nixl-raw, each also "
                                   "with -shmtcp (UCX_TLS=shm,tcp) or -tcp (UCX_TLS=tcp); "
                                   "unsuffixed, UCX picks its transports."),
    mooncake_python: str = typer.Option(None, help=MOONCAKE_HELP),
    repeat: int = typer.Option(1, min=1, help="Run every side N times, interleaved; keep each "
                               "cell's best (noisy machines) or median (--stat)."),
    stat: str = typer.Option("best", help="Per cell over the repeats: best or median."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object per row instead of tables."),
    plot: str = typer.Option("transfer_bench.png",
                             help="Where to write the GB/s-vs-block-size plot ('' for none)."),
) -> None:
    """Transfer engine: kvplane tcp, shm and nixl vs real Mooncake TCP and bare NIXL vs raw
    socket and memcpy.

    Every side runs the same two-process loop; ratios are printed at the end. A side whose
    package is missing (Mooncake, nixl_cu12) is skipped with one line saying why. Ctrl-C
    prints the results measured so far and exits 130.
    """
    from kvplane.bench import transfer as tb

    opt = tb.Options(sizes=_ints(sizes), batches=_counts(batches, "--batches"),
                     ops=ops.split(","), buf_mb=buf_mb, duration=duration,
                     mooncake_python=mooncake_python, impls=impls.split(","), repeat=repeat,
                     stat=stat)
    if stat not in ("best", "median"):
        raise typer.BadParameter(f"{stat!r}: choose best or median", param_hint="--stat")
    got = _measure(tb, opt, as_json, lambda sink: tb.merged([sink], tb.KEY, stat))
    if not as_json:
        _transfer_tables(got)
    _finish(got, "kvplane bench transfer", lambda: tb.plot(got.rows, plot), plot)


def _transfer_tables(got: Measured) -> None:
    from kvplane.bench.report import table_console

    out = table_console()
    t = Table(title="measured")
    for c in ("impl", "op", "size", "batch", "GB/s", "ops/s", "p50 us"):
        t.add_column(c)
    for r in got.rows:
        t.add_row(r["impl"], r["op"], str(r["size"]), str(r["batch"]), f"{r['gb_s']:.3f}",
                  f"{r['ops_s']:.0f}", _fmt(r.get("p50_us")))
    out.print(t)
    rt = Table(title="ratios (kvplane tcp / raw socket, / Mooncake tcp; shm / memcpy)")
    for c in ("op", "size", "batch", "tcp GB/s", "tcp/raw", "tcp/mooncake", "shm/memcpy"):
        rt.add_column(c)
    for r in (r for r in got.ratios if r["side"] == "kvplane-tcp"):
        rt.add_row(r["op"], str(r["size"]), str(r["batch"]), f"{r['tcp_gb_s']:.3f}",
                   _fmt(r["tcp_vs_raw"]), _fmt(r["tcp_vs_mooncake"]), _fmt(r["shm_vs_memcpy"]))
    out.print(rt)
    nixl = [r for r in got.ratios if r["side"].startswith("nixl")]
    if nixl:
        out.print(_nixl_table(nixl))


def _nixl_table(rows: list[dict[str, Any]]) -> Table:
    """The NIXL ratios: kvplane nixl / NIXL raw (same UCX_TLS), each / raw socket and / memcpy."""
    t = Table(title="NIXL ratios (kvplane nixl / NIXL raw, same UCX_TLS; each / raw socket, / memcpy)")
    for c in ("UCX_TLS", "op", "size", "batch", "kvplane GB/s", "raw GB/s", "kv/raw", "kv/socket",
              "raw/socket", "kv/memcpy", "raw/memcpy"):
        t.add_column(c)
    for r in rows:
        t.add_row(r["ucx_tls"], r["op"], str(r["size"]), str(r["batch"]), _fmt(r["kvplane_gb_s"]),
                  _fmt(r["raw_gb_s"]), _fmt(r["kvplane_vs_raw"]), _fmt(r["kvplane_vs_socket"]),
                  _fmt(r["raw_vs_socket"]), _fmt(r["kvplane_vs_memcpy"]), _fmt(r["raw_vs_memcpy"]))
    return t


def register(app: typer.Typer) -> None:
    """Add the ``bench`` group to the root app."""
    app.add_typer(bench_app, name="bench")


@bench_app.command("store")
def store(
    sizes: str = typer.Option("4KiB,64KiB,1MiB,16MiB", help="Value sizes."),
    batch: str = typer.Option("32", help="Objects per batch call, comma separated (e.g. 32,128)."),
    duration: float = typer.Option(1.0, min=0.01, help="Seconds per cell."),
    clients: str = typer.Option("1,2", help="Client process counts (remote topology)."),
    sides: str = typer.Option("kvplane-tcp,kvplane-shm,mooncake,redis",
                              help="What to measure (kvplane-tcp-csum and kvplane-shm-csum: with store "
                                   "checksums on; kvplane-tcp-nocache: no location cache, every get asks the "
                                   "master first; kvplane-tcp-ha and kvplane-shm-ha: etcd + leader + "
                                   "standby, clients on etcd://)."),
    topologies: str = typer.Option("remote,local",
                                   help="remote: segment in another process; local: own segment."),
    segment_size: int = size_option("2GiB", help="Size of the pool's segment (a local client "
                                    "contributes half of it).", minimum=1 << 20),
    segment_mb: int = typer.Option(None, hidden=True, min=1, help="Old spelling: the segment "
                                   "size in MiB (use --segment-size)."),
    cap_mb: int = typer.Option(256, min=1, help="Live MiB per client before keys are recycled."),
    mooncake_python: str = typer.Option(None, help=MOONCAKE_HELP),
    repeat: int = typer.Option(1, min=1, help="Run everything N times, interleaved; keep each cell's best."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object per row."),
    plot: str = typer.Option("store_bench.png", help="PNG of GB/s vs value size ('' for none)."),
    api: str = typer.Option("zero-copy", help="zero-copy (put_from/get_into) or bytes "
                                              "(put/get returning bytes, put_batch/get_batch)."),
    working_set: str = typer.Option("0", help="Bytes of keys each client's gets cycle over "
                                              "(e.g. 512MiB, past the CPU caches; 0: what the put "
                                              "phase put, at most --cap-mb)."),
) -> None:
    """Store: kvplane (tcp and shared memory) vs real Mooncake store vs Redis 7, one run.

    A progress bar counts the steps (a bar on a terminal, a line per step when piped); a side
    that cannot run here (Mooncake, redis-server, etcd or NIXL missing) is one line saying why.
    Ctrl-C prints the results measured so far and exits 130.
    """
    from kvplane.bench import store as sb

    if api not in ("zero-copy", "bytes"):
        raise typer.BadParameter("choose zero-copy or bytes", param_hint="--api")
    opt = sb.Options(sizes=_ints(sizes), batches=_counts(batch, "--batch"), duration=duration,
                     clients=_counts(clients, "--clients"), sides=sides.split(","),
                     topologies=topologies.split(","),
                     segment_mb=segment_mb if segment_mb is not None else segment_size >> 20,
                     cap_mb=cap_mb,
                     mooncake_python=mooncake_python, repeat=repeat, api=api,
                     working_set_mb=_ints(working_set)[0] >> 20)
    got = _measure(sb, opt, as_json, lambda sink: sb.best_of([sink], sb.KEY))
    if not as_json:
        _store_tables(got)
    _finish(got, "kvplane bench store", lambda: sb.plot(got.rows, plot), plot)


def _store_tables(got: Measured) -> None:
    from kvplane.bench.report import table_console

    out = table_console()
    t = Table(title="measured (objects/s, GB/s, per-call latency)")
    for c in ("side", "topology", "clients", "op", "size", "batch", "obj/s", "GB/s", "p50 us", "p99 us"):
        t.add_column(c)
    for r in got.rows:
        t.add_row(r["impl"], r["topology"], str(r["clients"]), r["op"], str(r["size"]),
                  str(r["batch"]), f"{r['ops_s']:.0f}", f"{r['gb_s']:.3f}", f"{r['p50_us']:.0f}",
                  f"{r['p99_us']:.0f}")
    out.print(t)
    rt = Table(title="ratios (GB/s): kvplane / Mooncake, / Redis, / memcpy (local get), / floor "
                     "(one raw socket round trip of the call's bytes, remote get); ops/s: HA / "
                     "non-HA")
    for c in ("side", "topology", "clients", "op", "size", "batch", "vs mooncake", "vs redis",
              "vs memcpy", "vs floor", "HA / non-HA"):
        rt.add_column(c)
    for r in got.ratios:
        rt.add_row(r["side"], r["topology"], str(r["clients"]), r["op"], str(r["size"]),
                   str(r["batch"]), _fmt(r["vs_mooncake"]), _fmt(r["vs_redis"]), _fmt(r["vs_memcpy"]),
                   _fmt(r["vs_floor"]), _fmt(r.get("vs_non_ha")))
    out.print(rt)
