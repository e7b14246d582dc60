"""``kvplane conductor``: run the KV cache indexer (ZMQ ingest of vLLM KV events + HTTP API).

Thin: parses flags into a ConductorConfig and runs ConductorServer. No business logic here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from kvplane.cli.errors import check_ports
from kvplane.cli.lifecycle import (
    announce,
    no_auth_option,
    note,
    resolve_token,
    size_option,
    token_option,
)
from kvplane.common.errors import InvalidArgument

HELP = """Run the conductor: a global KV cache index fed by vLLM KV events,
answering Mooncake's tiered prefix queries (POST /query, /query_by_hash) on
http://HOST:PORT (OpenAPI at /docs). Every endpoint but /health needs the
token (X-KVPlane-Token or Authorization: Bearer): --token, KVPLANE_TOKEN or
the token file, where one is generated if none exists; `kvplane token`
prints it for curl.

\b
Try it without vLLM: a stand-in engine publishes KV events and queries:
  kvplane conductor &
  kvplane conductor demo

\b
Point vLLM at it, way 1 - engines connect to the conductor (one port):
  kvplane conductor --bind tcp://127.0.0.1:5557
  PYTHONHASHSEED=0 python -m vllm.entrypoints.openai.api_server \\
    --model MODEL --enable-prefix-caching \\
    --prefix-caching-hash-algo sha256 --kv-events-config \\
    '{"enable_kv_cache_events": true, "publisher": "zmq",
      "endpoint": "tcp://127.0.0.1:5557", "topic": "kv@e0"}'
  curl -XPOST localhost:13333/register -H "X-KVPlane-Token: $(kvplane token)" \\
    -H 'content-type: application/json' -d '{"instance_id": "e0",
    "modelname": "MODEL", "block_size": 16, "topic": "kv@e0"}'
(vLLM connects instead of binding when its endpoint has no '*';
give every engine its own topic.)

\b
Way 2 - the conductor connects to each engine (replay heals gaps):
  --kv-events-config '{"enable_kv_cache_events": true,
    "publisher": "zmq", "endpoint": "tcp://*:5557",
    "replay_endpoint": "tcp://*:5558"}'
  then register {"endpoint": "tcp://HOST:5557",
    "replay_endpoint": "tcp://HOST:5558", ...}
(with data parallelism add "dp_size": N; rank r uses port + r.)
A kvplane master's KV events need its token: add "token": "..." to the
registration (it is used for ZMQ PLAIN and never shown back).

\b
Hashing: engines need a fixed PYTHONHASHSEED (it seeds vLLM's NONE_HASH)
and the algorithm of --hash-algo/--hash-seed, or register their own
"hash_profile": {"algorithm": "sha256_cbor", "python_hash_seed": "0"}.
A registration whose profile differs from its model's context is refused
(409); events whose root block hashes do not reproduce are counted and
logged, shown in /instances ("hash_status": "mismatch"), and turn
/health "degraded" - never silently zero.
"""


def _load_registrations(path: Path) -> list[dict[str, object]]:
    """The /register bodies of ``--register-file``; an unreadable or malformed file is a usage
    error."""
    try:
        return _read_registrations(path)
    except FileNotFoundError as exc:
        raise typer.BadParameter(f"no such file: {path}", param_hint="--register-file") from exc
    except (InvalidArgument, OSError, json.JSONDecodeError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--register-file") from exc


def _read_registrations(path: Path) -> list[dict[str, object]]:
    data = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
        raise InvalidArgument(f"{path}: expected a JSON object or a list of /register bodies")
    return data


def run(
    ctx: typer.Context,
    host: str = typer.Option("127.0.0.1", help="HTTP bind address."),
    port: int = typer.Option(13333, help="HTTP port (Mooncake's default 13333; 0 = any free port).",
                             min=0, max=65535),
    token: str = token_option(),
    no_auth: bool = no_auth_option("the HTTP API (/register, /unregister, /query, "
                                   "/query_by_hash, /instances, /metrics, /docs): anyone could "
                                   "register engines, drop them and read the index"),
    bind: list[str] = typer.Option([], help="ZMQ SUB endpoint to bind for engines that connect "
                                   "their publisher (repeatable), e.g. tcp://127.0.0.1:5557."),
    hash_algo: str = typer.Option("sha256", help="Default hash algorithm: sha256 | sha256_cbor."),
    hash_seed: str = typer.Option("0", help="Default PYTHONHASHSEED of the engines ('random' = "
                                  "unset: only /query_by_hash can match)."),
    register_file: Path = typer.Option(None, help="JSON file with /register bodies to load at start."),
    max_batch_bytes: int = size_option("16MiB", help="Largest KV event batch accepted."),
    max_request_bytes: int = size_option("8MiB", help="Largest HTTP request body accepted."),
    replay_timeout: float = typer.Option(2.0, help="Seconds a gap replay may take.", min=0.001),
) -> None:
    """Run the conductor (see `kvplane conductor --help`)."""
    if ctx.invoked_subcommand is not None:
        return  # `kvplane conductor demo`: the subcommand runs, not the server
    from kvplane.conductor.api import to_registration
    from kvplane.conductor.config import ConductorConfig
    from kvplane.conductor.hashing import HashProfile
    from kvplane.conductor.server import ConductorServer

    try:
        cfg = ConductorConfig(
            host=host, port=port, token=resolve_token(token, no_auth),
            bind=tuple(bind), default_profile=HashProfile(hash_algo, hash_seed),  # type: ignore[arg-type]  # typer gives str; the config checks the name
            max_batch_bytes=max_batch_bytes,
            max_request_bytes=max_request_bytes, replay_timeout=replay_timeout)
    except InvalidArgument as exc:
        raise typer.BadParameter(str(exc)) from exc
    try:
        regs = [to_registration(d) for d in _load_registrations(register_file)] if register_file else []
    except InvalidArgument as exc:
        raise typer.BadParameter(str(exc), param_hint="--register-file") from exc
    check_ports(host, {"--port": port})
    server = ConductorServer(cfg)
    for reg in regs:
        server.conductor.register(reg)
    try:
        server.serve_forever(on_ready=lambda: _ready(server, hash_algo, hash_seed))
    except KeyboardInterrupt:
        pass  # uvicorn re-raises the SIGINT it handled; the shutdown already happened


def _ready(server: Any, hash_algo: str, hash_seed: str) -> None:
    note(f"kvplane conductor on {server.url} (zmq bind: {', '.join(server.zmq_endpoints) or 'none'}; "
         f"default hash profile {hash_algo} seed {hash_seed!r}: engines need "
         f"PYTHONHASHSEED={hash_seed} --prefix-caching-hash-algo {hash_algo})")
    announce("conductor", {"conductor": server.url, "zmq_bind": server.zmq_endpoints}, None,
             signals=False)


def register(app: typer.Typer) -> None:
    """Add ``conductor`` (the server) and ``conductor demo`` to the kvplane CLI."""
    from kvplane.cli.conductor_demo import demo

    group = typer.Typer(help=HELP, invoke_without_command=True, no_args_is_help=False)
    group.callback()(run)
    group.command("demo")(demo)
    app.add_typer(group, name="conductor")
