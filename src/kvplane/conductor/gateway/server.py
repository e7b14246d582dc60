"""Process wiring of ``kvplane router``: policy, index, ingest, pool, HTTP; the only module that binds.

``GatewayServer`` builds the shared scheduling policy from the registry (``name@knob=value`` plus
``--set`` overrides of its time model), the scheduling :class:`Router`, a private
:class:`Conductor` with its ZMQ :class:`EventIngestor` (the backends' KV events), the
:class:`BackendPool` and the FastAPI app. ``start()`` serves from a named daemon thread (tests,
embedding); ``serve_forever()`` from the calling thread (CLI). Before it reports ready it runs one
round of health checks and scrapes, so backends already up are in rotation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import httpx
from fastapi import FastAPI

from kvplane.common.auth import token_authenticator
from kvplane.common.errors import Timeout, Unavailable
from kvplane.common.http import GuardedServer
from kvplane.conductor.config import ConductorConfig
from kvplane.conductor.gateway.app import create_app
from kvplane.conductor.gateway.config import GatewayConfig
from kvplane.conductor.gateway.pool import BackendPool, GatewayPrefixes
from kvplane.conductor.gateway.proxy import Gateway
from kvplane.conductor.gateway.relay import stop_tasks
from kvplane.conductor.ingest import EventIngestor
from kvplane.conductor.scheduling.config import SimConfig
from kvplane.conductor.scheduling.policy import POLICIES, SchedulingPolicy, create_policy
from kvplane.conductor.scheduling.report import parse_spec
from kvplane.conductor.scheduling.router import Router
from kvplane.conductor.scheduling.timemodel import TimeModel
from kvplane.conductor.service import Conductor

log = logging.getLogger(__name__)
UPSTREAM_KEEPALIVE_S = 2.0  # seconds an idle upstream connection is kept for reuse


def sim_config(config: GatewayConfig) -> tuple[str, SimConfig]:
    """The registry name and the scheduling config a router runs its policy with.

    The policy spec's knobs and ``settings`` apply as in ``kvplane simulate``; the cluster's block
    size is the engines'. Unless ``reject`` is set the policy never rejects, and unless
    ``pull_hints`` is set Mooncake's prefix pulls are off (a proxied vLLM cannot pull).

    Raises:
        InvalidArgument: an unknown policy, knob or setting.
    """
    name, knobs = parse_spec(config.policy)
    POLICIES.load(name)
    cfg = SimConfig().with_overrides({**knobs, **dict(config.settings)})
    policy = cfg.policy
    if not config.reject:
        policy = replace(policy, rejection="none")
    if not config.pull_hints:
        policy = replace(policy, balancing_threshold=math.inf)
    cluster = replace(cfg.cluster, block_tokens=config.block_size or cfg.cluster.block_tokens)
    return name, replace(cfg, policy=policy, cluster=cluster)


def build_policy(config: GatewayConfig) -> tuple[SchedulingPolicy, SimConfig]:
    """The shared policy object for ``config`` (see :func:`sim_config`)."""
    name, cfg = sim_config(config)
    return create_policy(name, cfg.policy, TimeModel(cfg.model, cfg.cluster), cfg.seed), cfg


class GatewayServer:
    """Runs one router.

    Args:
        config: settings; ``port=0`` picks a free port (read :attr:`port` / :attr:`url`).
        transport: an httpx async transport for the upstream calls (tests pass a mock or an
            ASGI transport; default: the network).
    """

    def __init__(self, config: GatewayConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        policy, self.sim = build_policy(config)
        self.prefixes = GatewayPrefixes()
        self.router = Router(policy, self.prefixes, [], [], self.sim.model.decode_kv_capacity_tokens,
                             self.sim.model.decode_max_batch, colocated=not config.pd)
        self.conductor = Conductor(ConductorConfig(port=0, bind=config.bind,
                                                   default_profile=config.hash_profile))
        self.ingestor = EventIngestor(self.conductor, config.bind)
        # idle connections go after 2 s, before a backend's own keep-alive timer (vLLM's and
        # uvicorn's: 5 s) can close one as the router reuses it (the rest: Gateway._send)
        limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256,
                              keepalive_expiry=UPSTREAM_KEEPALIVE_S)
        self.client = httpx.AsyncClient(trust_env=False, transport=transport, limits=limits)
        self.pool = BackendPool(config, self.router, self.conductor, self.prefixes, self.client,
                                on_block_size=self._retime)
        self.gateway = Gateway(config, self.pool, self.router, self.client)
        self.app = create_app(self.gateway)
        self.app.router.lifespan_context = self._lifespan
        self._meta: Any = None
        # the pre-authenticating front (common.http): junk, idle and tokenless connections never
        # reach the event loop; the app's own token check stays as a second gate
        self._guard = self._bind()
        self.port: int = self._guard.port
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    def _bind(self) -> GuardedServer:
        cfg = self.config
        try:
            return GuardedServer(self.app, cfg.host, cfg.port, token_authenticator(cfg.token),
                                 "router", lifespan="on")
        except OSError as exc:
            self.ingestor.close()
            raise Unavailable(f"cannot bind {cfg.host}:{cfg.port}: {exc}") from exc

    def _retime(self, block_size: int) -> None:
        """The engines' block size is known: the policy's time model counts in their blocks."""
        cluster = replace(self.sim.cluster, block_tokens=block_size)
        self.sim = replace(self.sim, cluster=cluster)
        self.router.policy.time_model = TimeModel(self.sim.model, cluster)

    @property
    def url(self) -> str:
        """Base URL of the router."""
        return f"http://{self.config.host}:{self.port}"

    @property
    def zmq_endpoints(self) -> list[str]:
        """The bound SUB endpoints engines may connect their KV event publishers to."""
        return list(self.ingestor.endpoints)

    @contextlib.asynccontextmanager
    async def _lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        pool, cfg = self.pool, self.config
        if cfg.discover:
            from kvplane.transfer.metadata import open_metadata

            self._meta = open_metadata(cfg.discover, cfg.token)
            await pool.discover(self._meta)
        await pool.check_all()
        await pool.scrape_all()
        tasks = [asyncio.ensure_future(pool.watch_all()),
                 asyncio.ensure_future(pool.run(cfg.metrics_interval_s, pool.scrape_all, "metrics"))]
        if self._meta is not None:
            meta = self._meta
            tasks.append(asyncio.ensure_future(
                pool.run(cfg.discover_interval_s, lambda: pool.discover(meta), "discovery")))
        try:
            yield
        finally:
            left = await stop_tasks([*tasks, *pool.tasks()])
            if left:
                log.warning("router shutdown: %d background task(s) did not stop", len(left))
            await self.client.aclose()
            if self._meta is not None:
                self._meta.close()

    async def _serve(self, on_ready: Callable[[], None] | None = None) -> None:
        task = asyncio.ensure_future(self._guard.serve())
        try:
            while not self._guard.started and not task.done():
                await asyncio.sleep(0.01)  # uvicorn exposes readiness only as a flag
        finally:
            self._ready.set()
        if on_ready is not None and self._guard.started:
            on_ready()
        await task

    def start(self, timeout: float = 30.0) -> GatewayServer:
        """Start ingest and serve HTTP from a daemon thread; return once it accepts requests.

        Idempotent: a started server is returned as it is (so ``with server.start():`` works).

        Raises:
            Timeout: the HTTP server is not up within ``timeout`` seconds.
        """
        if self._thread is not None:
            return self
        self.ingestor.start(timeout)
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()),
                                        name="kvplane-router-http", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout) or not self._guard.started:
            self.close()
            raise Timeout(f"router HTTP server not up within {timeout}s")
        return self

    def serve_forever(self, on_ready: Callable[[], None] | None = None) -> None:
        """Serve in the calling thread until SIGINT/SIGTERM, then shut down."""
        self.ingestor.start()
        log.info("router listening on %s (policy %s, %s, zmq bind: %s)", self.url,
                 self.config.policy, "PD" if self.config.pd else "colocated",
                 self.zmq_endpoints or "none")
        try:
            asyncio.run(self._serve(on_ready))
        finally:
            self.close()

    def close(self, timeout: float = 10.0) -> None:
        """Stop HTTP, the background loops and ingest (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._guard.stop()
        if self._thread is not None:
            self._thread.join(timeout)
        self.ingestor.close(timeout)

    def __enter__(self) -> GatewayServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
