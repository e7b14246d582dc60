"""ServerThread: run an ASGI app under uvicorn in a daemon thread, ready when constructed."""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn


class ServerThread:
    """Runs a uvicorn server for an ASGI app in a daemon thread; ``.port`` is the bound port."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0,
                 timeout: float = 10.0) -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                limit_concurrency=1024, timeout_keep_alive=30)
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
