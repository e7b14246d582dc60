"""Prometheus metrics shared by every kvplane service, plus helpers to serve them.

Metrics are module-level on the default registry so that one process exposes everything it
runs at one ``/metrics`` endpoint. Services with an HTTP app call :func:`add_route`; others can
call :func:`serve` for a standalone endpoint.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    make_asgi_app,
    start_http_server,
)

__all__ = [
    "CONTENT_TYPE_LATEST", "Counter", "Gauge", "Histogram", "add_route", "asgi_app", "render", "serve",
    "TRANSFER_BYTES", "TRANSFER_REQUESTS", "TRANSFER_RETRIES", "TRANSFER_FAILOVERS", "SERVER_FRAMES",
    "SERVER_REJECTED", "SERVER_CONNECTIONS", "METADATA_OPS", "TRANSFER_FABRIC",
    "TRANSFER_SLICES",
]

TRANSFER_BYTES = Counter(
    "kvplane_transfer_bytes_total", "Bytes moved by the initiator", ["op", "transport"]
)
TRANSFER_REQUESTS = Counter(
    "kvplane_transfer_requests_total", "Transfer requests finished", ["op", "status"]
)
TRANSFER_RETRIES = Counter(
    "kvplane_transfer_retries_total", "Slices retried on a fresh connection", ["transport"]
)
TRANSFER_FAILOVERS = Counter(
    "kvplane_transfer_failovers_total", "Slices re-run on TCP after a same-host transport failed",
    ["transport"]
)
TRANSFER_SLICES = Counter(
    "kvplane_transfer_slices_total", "Slices (whole requests, for unsliced transports) handed to "
    "a transport", ["transport"]
)
TRANSFER_FABRIC = Gauge(
    "kvplane_transfer_fabric_info",
    "1 per protocol choice an engine of this process made (kvplane.transfer.fabric)",
    ["requested", "protocol", "transports"]
)
SERVER_FRAMES = Counter("kvplane_transfer_server_frames_total", "Frames served", ["op"])
SERVER_REJECTED = Counter(
    "kvplane_transfer_server_rejected_total", "Connections closed for bad input", ["reason"]
)
SERVER_CONNECTIONS = Gauge("kvplane_transfer_server_connections", "Open inbound data connections")
METADATA_OPS = Counter("kvplane_metadata_ops_total", "Metadata backend operations", ["backend", "op"])


def render() -> tuple[bytes, str]:
    """The current exposition text and its content type."""
    return generate_latest(), CONTENT_TYPE_LATEST


def add_route(app: Any) -> None:
    """Serve the exposition at ``/metrics`` (and ``/metrics/``) of a FastAPI/Starlette app with
    no redirect: a plain ``curl http://HOST:PORT/metrics`` prints it."""
    from starlette.responses import Response

    async def exposition(request: Any) -> Response:
        body, ctype = render()
        return Response(body, media_type=ctype)

    for path in ("/metrics", "/metrics/"):
        app.add_route(path, exposition, methods=["GET"], include_in_schema=False)


def asgi_app() -> Any:
    """An ASGI app serving /metrics, to mount inside a FastAPI service."""
    return make_asgi_app()


def serve(port: int, host: str = "127.0.0.1") -> int:
    """Serve /metrics on its own port (0 picks one) in a daemon thread; returns the port."""
    server, _thread = start_http_server(port, addr=host)
    return int(server.server_port)
