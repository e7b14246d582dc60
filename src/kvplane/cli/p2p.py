"""``kvplane p2p publish|get|ls|rm``: the P2P store from the shell.

The tracker is the ``kvplane metadata`` server (or ``kvplane serve``): ``--tracker`` or
``KVPLANE_P2P_TRACKER``, default ``http://127.0.0.1:8080``.
"""

from __future__ import annotations

import json
import mmap
import os
import re
from typing import Any

import typer

from kvplane.cli.errors import check_ports
from kvplane.cli.lifecycle import announce, hold_logs, release, size_option, wait_for_signal

app = typer.Typer(help="P2P store: publish files once, fetch them on many nodes (docs/p2p.md).",
                  no_args_is_help=True)
_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")

TrackerOpt = typer.Option(None, help="Tracker URL (default KVPLANE_P2P_TRACKER or http://127.0.0.1:8080).")
TokenOpt = typer.Option(None, help="Token of the tracker and peers (default KVPLANE_TOKEN, else "
                        "the token file that kvplane services write).")
HostOpt = typer.Option("127.0.0.1", help="Address this node's data listener binds and advertises.")


def _node(tracker: str | None, token: str | None, host: str, **kw: Any) -> Any:
    from kvplane.p2p import P2PConfig, P2PNode

    return P2PNode(P2PConfig.from_env(tracker=tracker, token=token, host=host, **kw))


@app.command()
def publish(
    name: str = typer.Argument(..., help="Object name, e.g. llama-8b/step-120."),
    paths: list[str] = typer.Argument(..., help="Files to publish (items are named by base name)."),
    version: int = typer.Option(0, help="Version number (0: latest + 1)."),
    chunk_size: int = size_option("4MiB", help="Chunk size."),
    tracker: str = TrackerOpt, token: str = TokenOpt, host: str = HostOpt,
    port: int = typer.Option(0, help="Data port (0: any free one).", min=0, max=65535),
    ready_file: str = typer.Option(None, help="Also write the ready line here."),
) -> None:
    """Publish files (mapped, not copied) and serve them until Ctrl-C / SIGTERM.

    Prints one JSON line (name, version, segment, size) once receivers can fetch.
    """
    for path in paths:
        if not os.path.isfile(path):
            raise typer.BadParameter(f"no such file: {path}", param_hint="PATHS")
    hold_logs()
    check_ports(host, {"--port": port})
    node = _node(tracker, token, host, port=port, chunk_size=chunk_size)
    try:
        v = node.publish_files(name, paths, version)
        announce("p2p publish", {"name": name, "version": v, "segment": node.name,
                  "size": sum(os.path.getsize(p) for p in paths), "files": len(paths)}, ready_file)
        wait_for_signal()
    finally:
        node.close()


def _out_buffers(manifest: Any, out: str) -> tuple[dict[str, Any], list[mmap.mmap]]:
    os.makedirs(out, exist_ok=True)
    bufs: dict[str, Any] = {}
    maps: list[mmap.mmap] = []
    for it in manifest.items:
        if not _FILE.match(it.name):
            raise typer.BadParameter(f"item {it.name!r} is not a plain file name")
        path = os.path.join(out, it.name)
        with open(path, "wb+") as f:
            f.truncate(it.size)
            if it.size == 0:
                bufs[it.name] = bytearray()
                continue
            mm = mmap.mmap(f.fileno(), it.size)
        maps.append(mm)
        bufs[it.name] = mm
    return bufs, maps


@app.command()
def get(
    name: str = typer.Argument(..., help="Object name."),
    out: str = typer.Option(..., help="Directory to write the items into (one file each)."),
    version: int = typer.Option(0, help="Version (0: latest)."),
    timeout: float = typer.Option(600.0, help="Seconds for the whole fetch."),
    seed: float = typer.Option(0.0, help="Keep serving what it got for this many seconds."),
    strategy: str = typer.Option("rarest", help="Holder choice: rarest or least-loaded."),
    parallel: int = typer.Option(4, help="Chunks fetched at once."),
    tracker: str = TrackerOpt, token: str = TokenOpt, host: str = HostOpt,
) -> None:
    """Fetch NAME from every holder into --out; every chunk is verified against its hash.

    Chunks land straight in the output files (memory-mapped). Prints one JSON summary line.
    """
    import threading

    hold_logs()  # a failed fetch prints only its one line; a good one its lines, then the summary
    node = _node(tracker, token, host, strategy=strategy, parallel=parallel)
    maps: list[mmap.mmap] = []
    try:
        m = node.tracker.open(name, node.name, version)
        bufs, maps = _out_buffers(m, out)
        res = node.get(name, m.version, out=bufs, timeout=timeout, keep=seed > 0)
        for mm in maps:
            mm.flush()
        with open(os.path.join(out, ".manifest.json"), "wb") as f:
            from kvplane.p2p.manifest import encode

            f.write(encode(res.manifest))
        release(show=True)
        typer.echo(json.dumps({"name": name, "version": res.manifest.version,
                               "size": res.manifest.total_size, "seconds": res.stats.seconds,
                               "sources": res.stats.sources, "failures": res.stats.failures}))
        if seed > 0:
            threading.Event().wait(seed)
    finally:
        node.close()
        for mm in maps:
            try:
                mm.close()
            except BufferError:
                pass


@app.command("ls")
def ls_(
    prefix: str = typer.Argument("", help="Only names starting with this."),
    as_json: bool = typer.Option(False, "--json", help="JSON instead of a table."),
    tracker: str = TrackerOpt, token: str = TokenOpt,
) -> None:
    """List published names, their versions, holders and readers."""
    from kvplane.p2p import TrackerClient
    from kvplane.p2p.node import P2PConfig

    cfg = P2PConfig.from_env(tracker=tracker, token=token)
    client = TrackerClient(cfg.tracker, cfg.token)
    try:
        rows = client.ls(prefix)
    finally:
        client.close()
    if as_json:
        typer.echo(json.dumps(rows))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("name", "version", "size", "chunks", "holders", "readers", "state")
    for r in rows:
        for v in r["versions"]:
            table.add_row(r["name"], str(v["version"]), str(v["size"]), str(v["chunks"]),
                          str(v["holders"]), str(v["readers"]),
                          "retired" if v["retired"] else "latest")
    Console().print(table)


@app.command()
def rm(
    name: str = typer.Argument(..., help="Object name."),
    tracker: str = TrackerOpt, token: str = TokenOpt,
) -> None:
    """Retire every version of NAME; each is collected once no reader holds it."""
    from kvplane.p2p import TrackerClient
    from kvplane.p2p.node import P2PConfig

    cfg = P2PConfig.from_env(tracker=tracker, token=token)
    client = TrackerClient(cfg.tracker, cfg.token)
    try:
        client.rm(name)
    finally:
        client.close()
    typer.echo(json.dumps({"removed": name}))


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="p2p")
