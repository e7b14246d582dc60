"""Process wiring: Conductor + ZMQ ingest thread + HTTP server; the only module that binds.

The HTTP server runs behind the guard of ``kvplane.common.http`` (connection admission,
header and body timeouts, the token gate on every path but ``/health``).

``ConductorServer`` is a context manager. ``start()`` serves HTTP from a named daemon thread
(tests, embedding); ``serve_forever()`` serves from the calling thread with signal handling (CLI).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from kvplane.common.auth import token_authenticator
from kvplane.common.errors import Timeout, Unavailable
from kvplane.common.http import GuardedServer
from kvplane.conductor.api import create_app
from kvplane.conductor.config import ConductorConfig
from kvplane.conductor.ingest import EventIngestor
from kvplane.conductor.service import Conductor

log = logging.getLogger(__name__)


class ConductorServer:
    """Runs one conductor: index, ingest, HTTP API.

    Args:
        config: settings; ``port=0`` picks a free port (read :attr:`port` / :attr:`url`).
    """

    def __init__(self, config: ConductorConfig | None = None) -> None:
        self.config = config or ConductorConfig()
        self.conductor = Conductor(self.config)
        self.ingestor = EventIngestor(self.conductor, self.config.bind)
        self.app = create_app(self.conductor)
        try:
            self._http = GuardedServer(self.app, self.config.host, self.config.port,
                                       token_authenticator(self.config.token), "conductor",
                                       lifespan="on")
        except OSError as exc:
            self.ingestor.close()
            raise Unavailable(f"cannot bind {self.config.host}:{self.config.port}: {exc}") from exc
        self.port: int = self._http.port
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def url(self) -> str:
        """Base URL of the HTTP API."""
        return f"http://{self.config.host}:{self.port}"

    @property
    def zmq_endpoints(self) -> list[str]:
        """The bound SUB endpoints engines may connect their publishers to."""
        return list(self.ingestor.endpoints)

    async def _serve(self, on_ready: Callable[[], None] | None = None) -> None:
        task = asyncio.ensure_future(self._http.serve())
        try:
            while not self._http.started and not task.done():
                await asyncio.sleep(0.01)  # uvicorn exposes readiness only as a flag
        finally:
            self._ready.set()
        if on_ready is not None and self._http.started:
            on_ready()
        await task

    def start(self, timeout: float = 10.0) -> ConductorServer:
        """Start ingest and serve HTTP from a daemon thread; return once it accepts requests.

        Raises:
            Timeout: if the HTTP server is not up within ``timeout`` seconds.
        """
        self.ingestor.start(timeout)
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()),
                                        name="kvplane-conductor-http", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout) or not self._http.started:
            self.close()
            raise Timeout(f"conductor HTTP server not up within {timeout}s")
        return self

    def serve_forever(self, on_ready: Callable[[], None] | None = None) -> None:
        """Serve in the calling thread until SIGINT/SIGTERM, then shut down.

        Args:
            on_ready: called once the HTTP server accepts connections.
        """
        self.ingestor.start()
        log.info("conductor listening on %s (zmq bind: %s)", self.url, self.zmq_endpoints or "none")
        try:
            asyncio.run(self._serve(on_ready))
        finally:
            self.close()

    def close(self, timeout: float = 5.0) -> None:
        """Stop HTTP and ingest (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._http.stop()
        if self._thread is not None:
            self._thread.join(timeout)
        self.ingestor.close(timeout)

    def __enter__(self) -> ConductorServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
