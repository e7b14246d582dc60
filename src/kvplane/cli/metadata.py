"""``kvplane metadata``: the HTTP metadata server (Mooncake's /metadata protocol)."""

from __future__ import annotations

import typer

from kvplane.cli.errors import check_ports
from kvplane.cli.lifecycle import (
    announce,
    no_auth_option,
    resolve_token,
    token_option,
    wait_for_signal,
)


def metadata(
    host: str = typer.Option("127.0.0.1", help="Bind address (loopback unless you mean it)."),
    port: int = typer.Option(8080, help="Port; engines use --metadata http://HOST:PORT/metadata "
                             "(0 = any free port).", min=0, max=65535),
    token: str = token_option(),
    no_auth: bool = no_auth_option("GET/PUT/DELETE /metadata (anyone can read, replace or delete "
                                   "segment descriptors and so redirect transfers), the P2P "
                                   "tracker under /p2p, /metrics and /docs"),
    p2p: bool = typer.Option(True, "--p2p/--no-p2p", help="Also serve the P2P tracker under /p2p."),
    ready_file: str = typer.Option(None, help="Write the bound address here as JSON once ready."),
) -> None:
    """Run the segment metadata server: GET|PUT|DELETE /metadata?key=K, /health, /metrics.

    Engines publish their segment descriptors here and peers look them up (sending the token
    in X-KVPlane-Token). It keeps data in memory only; engines re-publish on their own when it
    restarts empty. With --p2p (the default) it is also the tracker of `kvplane p2p` (routes
    under /p2p). Prints one JSON line with the URL once listening.
    """
    from kvplane.transfer.metadata_server import serve_in_thread

    plugins = []
    if p2p:
        from kvplane.p2p.tracker_api import mount

        plugins.append(mount)
    tok = resolve_token(token, no_auth)
    check_ports(host, {"--port": port})
    srv = serve_in_thread(host, port, tok, plugins)
    try:
        announce("metadata", {"metadata": f"http://{host}:{srv.port}/metadata",
                              "p2p_tracker": f"http://{host}:{srv.port}" if p2p else None},
                 ready_file)
        wait_for_signal()
    finally:
        srv.close()


def register(app: typer.Typer) -> None:
    app.command("metadata")(metadata)
