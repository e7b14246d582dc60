"""The HTTP metadata server: Mooncake's ``GET|PUT|DELETE /metadata?key=K`` protocol on FastAPI.

In memory only (like Mooncake's), so engines re-publish when it restarts empty. Also serves
``/health``, ``/metrics`` and the OpenAPI spec. Binding happens in :func:`serve_in_thread`
(the CLI uses it too), behind the HTTP guard and token gate of ``kvplane.common.http``: every
path but ``/health`` needs the token; :func:`create_app` is pure. Other services mount their
routes through ``plugins`` (the CLI mounts the P2P tracker this way), so this module imports
none of them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, HTTPException, Query, Request, Response

from kvplane.common import metrics
from kvplane.common.auth import token_authenticator
from kvplane.common.http import ServerThread

MAX_VALUE = 1 << 20  # Mooncake's handshake/metadata limit (MC_HANDSHAKE_MAX_LENGTH)
MAX_KEY = 1024
MAX_KEYS = 100_000

_KEYS = metrics.Gauge("kvplane_metadata_keys", "Keys held by the HTTP metadata server")


Auth = Callable[[str | None], None]
Plugin = Callable[[FastAPI, Auth], Any]


def create_app(token: str = "", plugins: Sequence[Plugin] = ()) -> FastAPI:
    """Build the app. The token gate in front of it (``serve_in_thread``) checks every request.

    Args:
        token: what ``auth`` checks for plugins that check again ("" = nothing).
        plugins: each is called as ``plugin(app, auth)`` to add its routes; ``auth(header)``
            raises 401 unless the header carries the token.
    """
    app = FastAPI(title="kvplane metadata", version="1",
                  description="Segment metadata store (Mooncake-compatible /metadata API)")
    table: dict[str, bytes] = {}
    lock = threading.Lock()
    KeyQ = Query(..., min_length=1, max_length=MAX_KEY, description="metadata key")
    check = token_authenticator(token)

    def auth(value: str | None) -> None:
        if check(value or "") is None:
            raise HTTPException(401, "bad or missing X-KVPlane-Token")

    @app.get("/metadata", responses={404: {"description": "no such key"}})
    def get_key(key: str = KeyQ) -> Response:
        with lock:
            value = table.get(key)
        if value is None:
            raise HTTPException(404, "metadata not found")
        return Response(value, media_type="application/json")

    @app.put("/metadata", responses={413: {"description": "value too large"}})
    async def put_key(request: Request, key: str = KeyQ) -> dict[str, str]:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_VALUE:
                raise HTTPException(413, f"value larger than {MAX_VALUE} bytes")
        with lock:
            if key not in table and len(table) >= MAX_KEYS:
                raise HTTPException(507, "metadata server full")
            table[key] = bytes(body)
            _KEYS.set(len(table))
        return {"status": "ok"}

    @app.delete("/metadata")
    def delete_key(key: str = KeyQ) -> dict[str, str]:
        with lock:
            found = table.pop(key, None) is not None
            _KEYS.set(len(table))
        if not found:
            raise HTTPException(404, "metadata not found")
        return {"status": "ok"}

    @app.get("/health")
    def health() -> dict[str, object]:
        return {"status": "ok", "keys": len(table)}

    for plugin in plugins:
        plugin(app, auth)
    metrics.add_route(app)  # no 307 to /metrics/: plain curl prints it
    return app


def serve_in_thread(host: str = "127.0.0.1", port: int = 0, token: str = "",
                    plugins: Sequence[Plugin] = ()) -> ServerThread:
    """Start the metadata server in this process; returns once it accepts connections.

    ``token``: required on every path but ``/health`` ("" = open: ``--no-auth``).
    """
    return ServerThread(create_app(token, plugins), host, port,
                        authenticate=token_authenticator(token), name="metadata")
