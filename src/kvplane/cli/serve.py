"""``kvplane serve``: metadata server + transfer engine with a DRAM segment, on loopback."""

from __future__ import annotations

import signal
import threading

import typer

from kvplane.common import envs


def serve(
    host: str = typer.Option("127.0.0.1", help="Bind address of every service."),
    metadata_port: int = typer.Option(8080, help="HTTP metadata server port (served at /metadata)."),
    data_port: int = typer.Option(0, help="Transfer engine data/handshake port (0 = any free)."),
    segment_size: str = typer.Option("1GiB", help="DRAM this node contributes, e.g. 4GiB."),
    token: str = typer.Option(None, help="Shared token (default KVPLANE_TOKEN)."),
    ready_file: str = typer.Option(None, help="Write a JSON line with the bound ports here once ready."),
) -> None:
    """Run a node on embedded defaults: the metadata server and one shared-memory DRAM segment.

    Peers reach the segment as NAME through --metadata http://HOST:METADATA_PORT/metadata, by
    TCP from anywhere or by shared memory on this host. Ctrl-C stops it.
    """
    import json

    from kvplane.common.config import parse_size
    from kvplane.transfer import EngineConfig, TransferEngine
    from kvplane.transfer.metadata_server import serve_in_thread

    tok = token if token is not None else envs.get("KVPLANE_TOKEN")
    size = parse_size(segment_size)
    meta = serve_in_thread(host, metadata_port, tok)
    url = f"http://{host}:{meta.port}/metadata"
    te = TransferEngine(EngineConfig.from_env(host=host, port=data_port, metadata=url, token=tok))
    buf = te.allocate_managed_buffer(size)
    info = {"metadata": url, "segment": te.name, "data_port": te.port, "base": buf.addr,
            "size": size}
    typer.echo(json.dumps(info))
    if ready_file:
        with open(ready_file, "w", encoding="utf-8") as f:
            f.write(json.dumps(info) + "\n")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    te.close()
    meta.close()


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
