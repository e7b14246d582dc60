"""``kvplane status`` (one report, or ``--json``) and ``kvplane top`` (the same, refreshed).

Both read the master's ``GET /status`` on its admin port and, with ``--conductor``, the
conductor's ``/health`` and ``/instances``, with the local token (``--token``, KVPLANE_TOKEN,
or the token file) as ``Authorization: Bearer``. Rendering is rich tables; nothing here keeps
state between refreshes.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import typer

from kvplane.cli.lifecycle import human

# --sort columns of the segment table: (status-document field, numbers sort largest first)
SORTS = {"name": ("name", False), "status": ("status", False), "used": ("used_bytes", True),
         "capacity": ("capacity_bytes", True), "usage": ("usage_percent", True),
         "replicas": ("replicas", True), "heartbeat": ("heartbeat_age_s", True)}


class Unreachable(Exception):
    """A service did not answer (message: what and how to fix it)."""


def _get(client: Any, url: str, what: str, option: str) -> Any:
    import httpx

    try:
        r = client.get(url)
    except httpx.HTTPError as exc:
        raise Unreachable(f"{what} at {url} is unreachable ({type(exc).__name__}: {exc}); is it "
                          f"running? pass its address with {option}") from exc
    if r.status_code in (401, 403):
        raise Unreachable(f"{what} at {url} refused the token ({r.status_code}); pass --token "
                          "or set KVPLANE_TOKEN to the service token")
    if r.status_code != 200:
        raise Unreachable(f"{what} at {url} answered {r.status_code}: {r.text[:200]}")
    return r.json()


def collect(admin: str, conductor: str | None, token: str, timeout: float) -> dict[str, Any]:
    """The master's status document, plus the conductor's health and instances when asked."""
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(headers=headers, timeout=timeout, trust_env=False) as client:
        out: dict[str, Any] = _get(client, f"{admin.rstrip('/')}/status",
                                   "the master's admin port", "--admin")
        if conductor:
            base = conductor.rstrip("/")
            out["conductor"] = {"url": base,
                                "health": _get(client, f"{base}/health", "the conductor", "--conductor"),
                                "instances": _get(client, f"{base}/instances", "the conductor",
                                                  "--conductor")}
    return out


def sort_segments(rows: list[dict[str, Any]], sort: str, reverse: bool = False) -> list[dict[str, Any]]:
    """Segment rows ordered by a ``SORTS`` column (numbers largest first; ``reverse`` flips)."""
    field, numeric = SORTS[sort]
    rows = sorted(rows, key=lambda r: r["name"])  # stable tie-break
    return sorted(rows, key=lambda r: (r[field] is None, r[field] if r[field] is not None else 0),
                  reverse=numeric != reverse)


def view(doc: dict[str, Any], sort: str = "usage", reverse: bool = False) -> Any:
    """The report as one rich renderable."""
    from rich.console import Group
    from rich.table import Table

    m, o, per = doc["master"], doc["objects"], doc["ops"]["per_s"]
    used, cap = doc["used_bytes"], doc["capacity_bytes"]
    head = Table.grid(padding=(0, 2))
    head.add_row("master", f"{m['address']} ({m['role']}, epoch {m['epoch']}, "
                 f"up {m['uptime_s']:.0f} s, admin port {m['admin_port']})")
    for other in doc.get("masters", []):
        if other.get("address") != m["address"]:
            head.add_row("", f"{other['address']} ({other.get('role', '?')})")
    head.add_row("pool", f"{human(used)} of {human(cap)} used "
                 f"({100 * used / cap if cap else 0:.1f} %), {len(doc['segments'])} segments, "
                 f"{doc['clients']} clients")
    head.add_row("objects", f"{o['objects']} objects, {o['replicas']} replicas, {human(o['bytes'])}, "
                 f"{o['pending_puts']} puts in flight, {o['under_replicated']} under-replicated")
    head.add_row("evictions", f"{doc['evictions']['total']} ({per['evictions']:.1f}/s), "
                 f"{doc['evictions']['alloc_failures']} allocation failures")
    head.add_row("ops/s", f"put {per['put']:.1f}  get {per['get']:.1f}  "
                 f"remove {per['remove']:.1f}  exist {per['exist']:.1f}")
    parts: list[Any] = [head, _segment_table(doc["segments"], sort, reverse)]
    if "conductor" in doc:
        parts.append(_conductor_table(doc["conductor"]))
    return Group(*parts)


def _segment_table(rows: list[dict[str, Any]], sort: str, reverse: bool) -> Any:
    from rich.table import Table

    table = Table(title=f"segments (sorted by {sort})", title_justify="left")
    for col in ("segment", "status", "endpoint", "used", "capacity", "usage", "replicas", "heartbeat"):
        table.add_column(col, justify="right" if col in ("used", "capacity", "usage", "replicas",
                                                         "heartbeat") else "left")
    style = {"alive": "green", "late": "yellow", "suspect": "red"}
    for s in sort_segments(rows, sort, reverse):
        age = s["heartbeat_age_s"]
        table.add_row(s["name"], f"[{style.get(s['status'], '')}]{s['status']}", s["endpoint"],
                      human(s["used_bytes"]), human(s["capacity_bytes"]),
                      f"{s['usage_percent']:.1f} %", str(s["replicas"]),
                      "-" if age is None else f"{age:.1f} s ago")
    return table


def _conductor_table(cond: dict[str, Any]) -> Any:
    from rich.table import Table

    h = cond["health"]
    table = Table(title=f"conductor {cond['url']}: {h.get('status')}, {h.get('streams')} streams, "
                  f"{h.get('blocks')} blocks", title_justify="left")
    for col in ("instance", "rank", "type", "model", "events", "batches", "last seq", "blocks", "hashes"):
        table.add_column(col)
    for i in cond["instances"]:
        blocks = ", ".join(f"{k.lower()} {v}" for k, v in (i.get("blocks") or {}).items() if v)
        table.add_row(str(i["instance_id"]), str(i["dp_rank"]), str(i["type"]), str(i["modelname"]),
                      str(i.get("events", "?")), str(i["batches"]), str(i["last_seq"]),
                      blocks or "0", str(i["hash_status"]))
    return table


def _console() -> Any:
    """A rich console; piped output gets 160 columns (rich's 80 would cut segment names)."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)


def _token(token: str | None) -> str:
    from kvplane.common.auth import client_token

    return token if token is not None else client_token()


AdminOpt = typer.Option("http://127.0.0.1:9003", "--admin", help="The master's admin URL (its --admin-port).")
ConductorOpt = typer.Option(None, help="Also show this conductor's instances (e.g. http://127.0.0.1:13333).")
TokenOpt = typer.Option(None, help="Service or admin token (default: KVPLANE_TOKEN, else the local token "
                                   "file).")
TimeoutOpt = typer.Option(5.0, help="Seconds to wait for each answer.")
SortOpt = typer.Option("usage", help=f"Segment column to sort by: {', '.join(SORTS)} (numbers "
                       "largest first).")
ReverseOpt = typer.Option(False, "--reverse", help="Reverse the sort order.")


def _check_sort(sort: str) -> None:
    if sort not in SORTS:
        raise typer.BadParameter(f"unknown column {sort!r}; one of {', '.join(SORTS)}", param_hint="--sort")


def status(admin: str = AdminOpt, conductor: str = ConductorOpt, token: str = TokenOpt,
           as_json: bool = typer.Option(False, "--json", help="Print the raw status document (JSON)."),
           sort: str = SortOpt, reverse: bool = ReverseOpt, timeout: float = TimeoutOpt) -> None:
    """One report of the pool: master, segments (capacity, usage, liveness), objects and
    replicas, evictions, ops/s, and with --conductor its instances and the events each ingested."""
    _check_sort(sort)
    try:
        doc = collect(admin, conductor, _token(token), timeout)
    except Unreachable as exc:
        typer.echo(f"kvplane status: {exc}", err=True)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
        return
    _console().print(view(doc, sort, reverse))


def top(admin: str = AdminOpt, conductor: str = ConductorOpt, token: str = TokenOpt,
        interval: float = typer.Option(2.0, min=0.1, help="Seconds between refreshes."),
        sort: str = SortOpt, reverse: bool = ReverseOpt,
        iterations: int = typer.Option(0, min=0, help="Stop after this many refreshes (0: until Ctrl-C)."),
        timeout: float = TimeoutOpt) -> None:
    """`kvplane status`, refreshed every --interval seconds until Ctrl-C. On a terminal it
    redraws in place; piped, it prints one report per refresh. Like status, it exits 1 when
    its last refresh could not read the master (or the conductor)."""
    _check_sort(sort)
    console = _console()
    tok = _token(token)
    failed: list[str] = []  # the last refresh's error, if it had one
    try:
        _loop(console, lambda n: _frame(admin, conductor, tok, timeout, sort, reverse, n, failed),
              interval, iterations)
    except KeyboardInterrupt:
        pass  # Ctrl-C is how top ends
    if failed:
        typer.echo(f"kvplane top: {failed[-1]}", err=True)
        raise typer.Exit(1)


def _frame(admin: str, conductor: str | None, token: str, timeout: float, sort: str,
           reverse: bool, n: int, failed: list[str]) -> Any:
    """Refresh ``n``; ``failed`` holds the error of the latest refresh (empty when it worked)."""
    from rich.console import Group
    from rich.text import Text

    stamp = Text(f"kvplane top · refresh {n} · {time.strftime('%H:%M:%S')} · {admin}", style="bold")
    failed.clear()
    try:
        return Group(stamp, view(collect(admin, conductor, token, timeout), sort, reverse))
    except Unreachable as exc:
        failed.append(str(exc))
        return Group(stamp, Text(str(exc), style="red"))


def _loop(console: Any, frame: Any, interval: float, iterations: int) -> None:
    from rich.live import Live

    n = 1
    if not console.is_terminal:  # piped: one report per refresh, like `top -b`
        while True:
            console.print(frame(n))
            sys.stdout.flush()
            if iterations and n >= iterations:
                return
            n += 1
            time.sleep(interval)
    with Live(frame(n), console=console, auto_refresh=False, screen=False) as live:
        while not iterations or n < iterations:
            time.sleep(interval)
            n += 1
            live.update(frame(n), refresh=True)


def register(app: typer.Typer) -> None:
    app.command("status")(status)
    app.command("top")(top)
