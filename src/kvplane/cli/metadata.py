"""``kvplane metadata``: the HTTP metadata server (Mooncake's /metadata protocol)."""

from __future__ import annotations

import typer

from kvplane.common import envs


def metadata(
    host: str = typer.Option("127.0.0.1", help="Bind address (loopback unless you mean it)."),
    port: int = typer.Option(8080, help="Port; engines use --metadata http://HOST:PORT/metadata."),
    token: str = typer.Option(None, help="Shared token required in X-KVPlane-Token (default KVPLANE_TOKEN)."),
    p2p: bool = typer.Option(True, "--p2p/--no-p2p", help="Also serve the P2P tracker under /p2p."),
) -> None:
    """Run the segment metadata server: GET|PUT|DELETE /metadata?key=K, /health, /metrics.

    Engines publish their segment descriptors here and peers look them up. It keeps data in
    memory only; engines re-publish on their own when it restarts empty. With --p2p (the
    default) it is also the tracker of `kvplane p2p` (routes under /p2p).
    """
    import uvicorn

    from kvplane.transfer.metadata_server import create_app

    plugins = []
    if p2p:
        from kvplane.p2p.tracker_api import mount

        plugins.append(mount)
    app = create_app(token if token is not None else envs.get("KVPLANE_TOKEN"), plugins)
    uvicorn.run(app, host=host, port=port, log_level="warning")


def register(app: typer.Typer) -> None:
    app.command("metadata")(metadata)
