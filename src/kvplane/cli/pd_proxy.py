"""``kvplane pd-proxy``: an alias of ``kvplane router --prefill URL --decode URL`` (one proxy, not two).

Kept so existing scripts run unchanged: its own flags (a subset of the router's; ``--timeout`` is
the router's ``--read-timeout``), its ready line ``{"proxy": URL, ...}``. The
proxying, routing (the prefill instance by Mooncake's Algorithm 1, the decode instance by
predicted load), retries and health checks are the router's (``kvplane.conductor.gateway``).
"""

from __future__ import annotations

import typer

from kvplane.cli.lifecycle import no_auth_option, resolve_token, token_option
from kvplane.common.errors import KVPlaneError


def pd_proxy(
    prefill: list[str] = typer.Option(..., "--prefill", help="Prefill instance base URL (repeat for X)."),
    decode: list[str] = typer.Option(..., "--decode", help="Decode instance base URL (repeat for Y)."),
    host: str = typer.Option("127.0.0.1", help="Bind address."),
    port: int = typer.Option(8000, help="Port (0 picks a free one; the ready line says which)."),
    timeout: float = typer.Option(300.0, help="Seconds to wait for upstream bytes (read timeout)."),
    policy: str = typer.Option("mooncake", help="Scheduling policy (see `kvplane router --help`)."),
    token: str = token_option(),
    no_auth: bool = no_auth_option("the OpenAI endpoints (/v1/completions, "
                                   "/v1/chat/completions, /v1/models): anyone could run "
                                   "requests on the instances behind it"),
) -> None:
    """Serve X prefill + Y decode vLLM instances (KVPlanePDConnector) behind one endpoint.

    Same as `kvplane router --prefill ... --decode ...` with fewer flags (--timeout is the router's
    --read-timeout; the router takes the rest); prints one JSON line {"proxy": URL, ...}.
    """
    from kvplane.cli.router import serve
    from kvplane.conductor.gateway.config import BackendSpec, GatewayConfig

    try:
        cfg = GatewayConfig(host=host, port=port, token=resolve_token(token, no_auth), mode="pd",
                            backends=tuple([BackendSpec.parse(u, "prefill") for u in prefill]
                                           + [BackendSpec.parse(u, "decode") for u in decode]),
                            policy=policy, read_timeout_s=timeout)
    except KVPlaneError as exc:
        raise typer.BadParameter(str(exc)) from exc
    serve(cfg)


def register(app: typer.Typer) -> None:
    """Add ``pd-proxy`` to the kvplane CLI."""
    app.command("pd-proxy")(pd_proxy)


if __name__ == "__main__":
    typer.run(pd_proxy)
