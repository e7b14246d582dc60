"""Every kvplane HTTP server: a pre-authenticating front handing connections to uvicorn's loop.

:class:`GuardedServer` binds its port with :class:`~kvplane.common.front.HttpFront`, which
admits each connection and reads and checks its first request head on one thread, then hands
it to uvicorn's event loop with what was read. The app runs behind the token gate (every path
but ``/health``, every request) and quiet client disconnects. :class:`ServerThread` runs one in a
daemon thread, ready when constructed.
"""

from __future__ import annotations

import asyncio
import functools
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import uvicorn

from kvplane.common.auth import Authenticator
from kvplane.common.front import HttpFront
from kvplane.common.guard import Limits
from kvplane.common.http_guard import GuardedH11, Head, QuietDisconnect, TokenGate, guarded_protocol

KEEP_ALIVE = 15  # seconds an idle keep-alive connection is kept
MAX_AUTHED = 1024  # connections uvicorn serves at once (all of them past authentication)


def metrics_app(status: Callable[[], dict[str, Any]] | None = None) -> Any:
    """A standalone metrics app: ``/health`` answers ok, ``/status`` (when ``status`` is given)
    its JSON document, every other path the exposition."""
    from kvplane.common import metrics

    exposition = metrics.asgi_app()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path") if scope["type"] == "http" else None
        if path == "/health" or (path == "/status" and status is not None):
            body = json.dumps(status() if path == "/status" and status else {"status": "ok"})
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body.encode()})
            return
        await exposition(scope, receive, send)
    return app


class QuietServer(uvicorn.Server):
    """uvicorn's server, its housekeeping once a second and its stop prompt.

    uvicorn's own main loop wakes every 0.1 s to see whether it should stop (and to refresh the
    Date header every tenth time). A host may run dozens of processes with an HTTP port each
    (every store segment serves its metrics), so that poll alone kept them all waking ten times
    a second. This one sleeps on an event that :meth:`request_stop` sets, and wakes once a
    second for the Date header.
    """

    TICK = 1.0  # seconds between the Date header's refreshes

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._stopping: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def main_loop(self) -> None:
        self._loop, self._stopping = asyncio.get_running_loop(), asyncio.Event()
        while not await self.on_tick(0):  # counter 0: the Date header, then should_exit
            try:
                await asyncio.wait_for(self._stopping.wait(), self.TICK)
            except TimeoutError:
                pass

    def request_stop(self) -> None:
        """From any thread: stop serving (``serve`` returns soon after; idempotent)."""
        self.should_exit = True
        loop, ev = self._loop, self._stopping
        if loop is not None and ev is not None:
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # the loop has closed: the server has stopped
                pass


def guard_app(app: Any, authenticate: Authenticator | None) -> Any:
    """``app`` behind the token gate (when ``authenticate`` is given) and QuietDisconnect."""
    if authenticate is not None:
        app = TokenGate(app, authenticate)
    return QuietDisconnect(app)


class GuardedServer:
    """An ASGI app served by uvicorn behind the pre-authentication front.

    The port is bound when constructed (read ``.port``); call :meth:`serve` in the thread that
    runs the event loop (it returns when the server stops).

    Args:
        app: the ASGI app.
        host: bind address.
        port: 0 picks a free one.
        authenticate: token -> principal for every path but ``/health`` (None: no token gate).
        name: server name (thread names, metrics label).
        limits: connection limits (default: from the environment).
        lifespan: uvicorn's lifespan mode ("on" runs the app's startup/shutdown).
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0,
                 authenticate: Authenticator | None = None, name: str = "http",
                 limits: Limits | None = None,
                 lifespan: Literal["auto", "on", "off"] = "off") -> None:
        self.limits = limits or Limits.from_env()
        self._auth = authenticate
        self._proto = guarded_protocol(self.limits, name)
        self.server = QuietServer(uvicorn.Config(
            guard_app(app, authenticate), http=self._proto, log_level="warning",
            lifespan=lifespan, limit_concurrency=MAX_AUTHED, timeout_keep_alive=KEEP_ALIVE,
            access_log=False))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._early: list[tuple[socket.socket, Head]] | None = []  # accepted before the loop ran
        self.front = HttpFront(host, port, self.limits, authenticate, name, self._handoff)
        self.host, self.port = self.front.host, self.front.port

    async def serve(self) -> None:
        """Run uvicorn on the current event loop until :meth:`stop`."""
        self._loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(self.server.serve(sockets=[]))
        try:
            while not self.server.started and not task.done():
                await asyncio.sleep(0.005)  # uvicorn exposes readiness only as a flag
            with self._lock:
                early, self._early = self._early or [], None
            for sock, head in early:
                self._adopt(sock, self._factory(head))
            await task
        finally:
            self.front.close()

    @property
    def started(self) -> bool:
        return bool(self.server.started)

    def stop(self) -> None:
        """Ask the server to stop (idempotent; :meth:`serve` returns soon after)."""
        self.server.request_stop()
        self.front.close()

    def _handoff(self, sock: socket.socket, head: Head) -> None:
        """On the front's thread: give an accepted connection to the event loop."""
        with self._lock:
            if self._early is not None:  # the loop is not serving yet: it adopts these first
                if len(self._early) < self.limits.max_preauth:
                    self._early.append((sock, head))
                else:
                    sock.close()
                return
        if self._loop is None or self.server.should_exit:
            sock.close()
            return
        try:
            self._loop.call_soon_threadsafe(self._adopt, sock, self._factory(head))
        except RuntimeError:  # the loop is gone
            sock.close()

    def _factory(self, head: Head) -> Any:
        return functools.partial(self._proto, config=self.server.config,
                                 server_state=self.server.server_state,
                                 app_state=self.server.lifespan.state, head=head)

    def _adopt(self, sock: socket.socket, factory: Any) -> None:
        assert self._loop is not None
        task = self._loop.create_task(self._loop.connect_accepted_socket(factory, sock))
        task.add_done_callback(lambda t: _close_on_error(t, sock))


def _close_on_error(task: asyncio.Task[Any], sock: socket.socket) -> None:
    if not task.cancelled() and task.exception() is not None:
        sock.close()


class ServerThread:
    """Runs a :class:`GuardedServer` in a daemon thread; ``.port`` is the bound port.

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
        self.server = GuardedServer(app, host, port, authenticate, name, limits)
        self.host, self.port = self.server.host, self.server.port
        self._thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()),
                                        name=f"http-{name}-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.server.stop()
                raise RuntimeError(f"HTTP server on {host}:{port} failed to start")
            time.sleep(0.005)  # readiness poll on the server's own flag

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        """Stop the server and join its thread (idempotent)."""
        self.server.stop()
        self._thread.join(5)

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["GuardedH11", "GuardedServer", "QuietServer", "ServerThread", "guard_app", "metrics_app"]
