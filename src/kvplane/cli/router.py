"""``kvplane router``: the cache-aware OpenAI gateway (docs/router.md). Thin: flags -> GatewayConfig."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from kvplane.cli.errors import check_ports
from kvplane.cli.lifecycle import announce, no_auth_option, resolve_token, size_option, token_option
from kvplane.common.errors import InvalidArgument, KVPlaneError

if TYPE_CHECKING:
    from kvplane.conductor.gateway.config import GatewayConfig

HELP = """Run a cache-aware OpenAI gateway in front of vLLM instances.

\b
Colocated: kvplane router --backend http://127.0.0.1:8001 --backend ...
PD:        kvplane router --prefill URL --decode URL  (KVPlanePDConnector)
A backend may carry options: URL,id=NAME,events=tcp://HOST:PORT,
replay=tcp://HOST:PORT,topic=TOPIC (vLLM's --kv-events-config
endpoint / replay_endpoint / topic). With --bind tcp://127.0.0.1:5557
the engines connect their publishers to the router instead; each then
publishes under topic kv@<id> (id defaults to host:port of its URL).

\b
Engines need --enable-prefix-caching, a fixed PYTHONHASHSEED (see
--hash-seed) and --prefix-caching-hash-algo as --hash-algo. Prints one
JSON line {"router": URL, "zmq": [...]} once listening.
"""


def run(
    backend: list[str] = typer.Option([], "--backend", help="Colocated vLLM server (repeatable): "
                                      "URL[,id=..][,events=..][,replay=..][,topic=..]."),
    prefill: list[str] = typer.Option([], "--prefill", help="PD prefill instance (repeatable)."),
    decode: list[str] = typer.Option([], "--decode", help="PD decode instance (repeatable)."),
    pool: list[str] = typer.Option([], "--pool", help="Shared KV pool whose KV events count "
                                   "for every instance (repeatable): EVENTS[,replay=..][,token=..]"
                                   "[,id=..][,type=kvplane|mooncake], e.g. a kvplane master's "
                                   "--kv-events-port endpoint."),
    discover: str = typer.Option("", help="Metadata service holding the backend list "
                                 "(http://H:P/metadata, etcd://H:P, redis://H:P)."),
    discover_key: str = typer.Option("kvplane/router/backends", help="Key of the JSON list of "
                                     "backend records {url, role?, id?, events?, replay?, topic?}."),
    mode: str = typer.Option("", help="colocated | pd (default: pd when --prefill/--decode given)."),
    policy: str = typer.Option("mooncake", help="Scheduling policy from the shared registry "
                               "(mooncake, mooncake-local, least-loaded, round-robin, random, "
                               "prefix, sglang, llmd); knobs as name@knob=value."),
    settings: list[str] = typer.Option([], "--set", help="Override the policy's model/cluster/"
                                       "policy config, e.g. model.prefill_fit=0.02,1e-4,1e-8 "
                                       "or policy.ttft_slo_s=5 (repeatable)."),
    reject: bool = typer.Option(False, "--reject/--no-reject", help="Early rejection: 429 + "
                                "Retry-After when the policy predicts an SLO miss."),
    retry_after: int = typer.Option(1, help="Retry-After seconds of a 429."),
    pull_hints: bool = typer.Option(False, help="Keep Mooncake's prefix pulls in decisions "
                                    "(/route reports the source; a proxied vLLM cannot pull)."),
    block_size: int = typer.Option(0, help="Engine KV block size (0: read from a backend's /metrics)."),
    model: str = typer.Option("", help="Model name of the index context (default: 'default')."),
    hash_algo: str = typer.Option("sha256", help="Engines' --prefix-caching-hash-algo."),
    hash_seed: str = typer.Option("0", help="Engines' PYTHONHASHSEED."),
    bind: list[str] = typer.Option([], help="ZMQ SUB endpoint engines connect their KV event "
                                   "publishers to (repeatable), e.g. tcp://127.0.0.1:5557."),
    host: str = typer.Option("127.0.0.1", help="Bind address."),
    port: int = typer.Option(8000, help="Port (0 picks a free one; the ready line says which).",
                             min=0, max=65535),
    token: str = token_option(),
    no_auth: bool = no_auth_option("the OpenAI endpoints, /route and /metrics: anyone could "
                                   "run requests on the engines behind it"),
    connect_timeout: float = typer.Option(2.0, help="Upstream connect timeout, s."),
    read_timeout: float = typer.Option(300.0, help="Longest wait for the next upstream bytes "
                                       "(the first token included), s."),
    request_timeout: float = typer.Option(600.0, help="Longest non-streamed upstream answer, s."),
    health_interval: float = typer.Option(0.5, help="Seconds between health checks."),
    health_timeout: float = typer.Option(0.5, help="Timeout of one health check, s."),
    retries: int = typer.Option(2, min=0, help="Times a request that failed before its first "
                                "token (refused, dropped, 5xx, ejected) is sent again, each time "
                                "to an instance not tried yet."),
    stream_grace: float = typer.Option(
        2.0, help="Once a backend is ejected, its running streams go on while each next token "
                  "arrives within this many seconds; a stalled one ends with an error event."),
    eject_after: int = typer.Option(2, help="Failed checks in a row that eject a backend "
                                    "(a refused connection ejects at once)."),
    max_request_bytes: int = size_option("8MiB", help="Largest request body accepted."),
) -> None:
    """Run the router (see `kvplane router --help`)."""
    from kvplane.conductor.gateway.config import BackendSpec, GatewayConfig, PoolSpec
    from kvplane.conductor.hashing import HashProfile

    try:
        specs = ([BackendSpec.parse(b) for b in backend]
                 + [BackendSpec.parse(b, "prefill") for b in prefill]
                 + [BackendSpec.parse(b, "decode") for b in decode])
        cfg = GatewayConfig(
            host=host, port=port, token=resolve_token(token, no_auth),
            mode=mode or ("pd" if prefill or decode else "colocated"),  # type: ignore[arg-type]  # str from typer; the config checks it
            backends=tuple(specs), pools=tuple(PoolSpec.parse(p) for p in pool),
            model=model, block_size=block_size,
            hash_profile=HashProfile(hash_algo, hash_seed, "vllm_v1_tagged"),  # type: ignore[arg-type]  # str from typer; the config checks it
            policy=policy, settings=_settings(settings),
            reject=reject, retry_after_s=retry_after, pull_hints=pull_hints, bind=tuple(bind),
            discover=discover, discover_key=discover_key, connect_timeout_s=connect_timeout,
            read_timeout_s=read_timeout, request_timeout_s=request_timeout,
            health_interval_s=health_interval, health_timeout_s=health_timeout,
            retries=retries, stream_grace_s=stream_grace,
            eject_after=eject_after, max_request_bytes=max_request_bytes)
    except KVPlaneError as exc:
        raise typer.BadParameter(str(exc)) from exc
    serve(cfg)


def _settings(items: list[str]) -> tuple[tuple[str, str], ...]:
    """``--set section.field=value`` items as pairs (an item without ``=`` is a bad parameter)."""
    out = []
    for item in items:
        key, eq, value = item.partition("=")
        if not eq:
            raise typer.BadParameter(f"--set takes section.field=value, got {item!r}")
        out.append((key, value))
    return tuple(out)


def serve(cfg: GatewayConfig) -> None:
    """Run a router for ``cfg`` until SIGINT/SIGTERM; print the ready line once listening.

    Raises:
        typer.BadParameter: an unknown policy or setting.
        kvplane.cli.errors.PortInUse: the port is taken.
    """
    from kvplane.conductor.gateway.server import GatewayServer, sim_config

    try:
        sim_config(cfg)  # an unknown policy or setting fails here, before anything binds
    except KVPlaneError as exc:
        raise typer.BadParameter(str(exc)) from exc
    check_ports(cfg.host, {"--port": cfg.port})
    try:
        server = GatewayServer(cfg)
    except InvalidArgument as exc:
        raise typer.BadParameter(str(exc)) from exc
    ready: dict[str, object] = {"router": server.url, "zmq": server.zmq_endpoints, "policy": cfg.policy,
             "mode": cfg.mode}
    if cfg.pd:
        ready["proxy"] = server.url  # the ready line `kvplane pd-proxy` always printed
    try:
        server.serve_forever(on_ready=lambda: announce(
            "pd-proxy" if "proxy" in ready else "router", ready, None, signals=False))
    except KeyboardInterrupt:
        pass  # uvicorn re-raises the SIGINT it handled; the shutdown already happened


def register(app: typer.Typer) -> None:
    """Add ``router`` to the kvplane CLI."""
    app.command("router", help=HELP, no_args_is_help=True)(run)


if __name__ == "__main__":
    typer.run(run)
