"""ServerThread: run an ASGI app under uvicorn in a daemon thread, ready when constructed.

Every kvplane HTTP server goes through :func:`uvicorn_config`, which puts the pre-authentication
guard of :mod:`kvplane.common.http_guard` in front of the app: connection admission, header and
body timeouts, the token gate (``/health`` stays open) and quiet client disconnects.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn

from kvplane.common.auth import Authenticator
from kvplane.common.guard import Limits
from kvplane.common.http_guard import QuietDisconnect, TokenGate, guarded_protocol

KEEP_ALIVE = 15  # seconds an idle keep-alive connection is kept


def guard_app(app: Any, authenticate: Authenticator | None) -> Any:
    """``app`` behind the token gate (when ``authenticate`` is given) and QuietDisconnect."""
    if authenticate is not None:
        app = TokenGate(app, authenticate)
    return QuietDisconnect(app)


def uvicorn_config(app: Any, authenticate: Authenticator | None, name: str,
                   limits: Limits | None = None, **kw: Any) -> uvicorn.Config:
    """A uvicorn Config serving ``app`` behind the guard (see the module docstring).

    Args:
        app: the ASGI app.
        authenticate: token -> principal; None serves without a token gate.
        name: server name (metrics label of rejected connections).
        limits: connection limits (default: ``Limits.from_env``).
        kw: more uvicorn.Config arguments (host, port, lifespan...).
    """
    kw.setdefault("log_level", "warning")
    kw.setdefault("lifespan", "off")
    return uvicorn.Config(guard_app(app, authenticate), http=guarded_protocol(limits or Limits.from_env(), name),
                          limit_concurrency=None, timeout_keep_alive=KEEP_ALIVE,
                          access_log=False, **kw)


class ServerThread:
    """Runs a uvicorn server for an ASGI app in a daemon thread; ``.port`` is the bound port.

    Args:
        app: the ASGI app.
        host: bind address.
        port: 0 picks a free one.
        timeout: seconds to wait for the server to accept connections.
        authenticate: token -> principal for every path but ``/health`` (None: no token gate).
        name: server name (metrics label).
        limits: connection limits (default: from the environment).
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0,
                 timeout: float = 10.0, authenticate: Authenticator | None = None,
                 name: str = "http", limits: Limits | None = None) -> None:
        config = uvicorn_config(app, authenticate, name, limits, host=host, port=port)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name=f"http-{port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"HTTP server on {host}:{port} failed to start")
            time.sleep(0.005)  # readiness poll on the server's own flag
        sock = self._server.servers[0].sockets[0]
        self.host, self.port = sock.getsockname()[:2]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        """Stop the server and join its thread (idempotent)."""
        self._server.should_exit = True
        self._thread.join(5)

    def __enter__(self) -> "ServerThread":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
