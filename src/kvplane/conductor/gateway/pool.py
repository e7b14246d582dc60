"""The router's backends: health checks (eject, re-admit), ``/metrics`` scrapes, discovery.

A :class:`BackendPool` owns one :class:`Backend` record per vLLM server. Background tasks (one
event loop; see ``server.py``) check each backend's ``/health`` every ``health_interval_s``, one
task per backend: a refused connection ejects at once, ``eject_after`` failed checks in a row
eject, ``admit_after`` good ones re-admit. Ejection tells the scheduling :class:`Router` to stop
offering the instance and fires the backend's ``gone`` event, which aborts the requests in flight
on it (``proxy.py`` retries those before their first token). Scrapes read vLLM's own gauges and
counters (requests running/waiting, prefix-cache queries/hits, block size and KV capacity from
``cache_config_info``). Once the block size is known, a backend that publishes KV events is
registered with the router's private :class:`Conductor`, whose ingest thread indexes its blocks.

No sockets are bound here; upstream calls go through the shared ``httpx.AsyncClient``, each with
its own timeout. Must not import FastAPI.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvplane.common import log as kvlog
from kvplane.common.errors import KVPlaneError
from kvplane.conductor.gateway import instruments
from kvplane.conductor.gateway.config import BackendSpec, GatewayConfig
from kvplane.conductor.indexer import Match
from kvplane.conductor.scheduling.prefix import ConductorPrefixes
from kvplane.conductor.scheduling.router import Router
from kvplane.conductor.service import Conductor, Registration

if TYPE_CHECKING:
    from kvplane.transfer.metadata import MetadataBackend

log = logging.getLogger(__name__)
CONTEXT_MODEL = "default"  # the private index's model name when --model is not given


@dataclass
class Backend:
    """One backend's state (mutated only on the router's event loop).

    Attributes:
        spec: where it is and how it publishes events.
        up: in rotation.
        fails: consecutive failed health checks.
        oks: consecutive good health checks.
        gone: set when the backend is ejected (aborts requests in flight on it).
        in_flight: requests this router has open on it.
        running: the engine's ``vllm:num_requests_running`` at the last scrape.
        waiting: the engine's ``vllm:num_requests_waiting`` at the last scrape.
        prefix_queries: the engine's ``vllm:prefix_cache_queries_total`` (tokens).
        prefix_hits: the engine's ``vllm:prefix_cache_hits_total`` (tokens).
        block_size: the engine's KV block size (from ``cache_config_info``), 0 = unknown.
        hash_algo: the engine's ``prefix_caching_hash_algo``.
        kv_capacity: the engine's KV capacity in tokens, 0 = unknown.
        registered: its KV event stream is registered with the index.
        listed: still in the discovered backend list (static backends always are).
        last_error: the last health or scrape error, for ``/backends``.
        seen: ``time.monotonic()`` of the last bytes a proxied call got from it (0 = never):
            proof of life that excuses a health check timing out meanwhile.
        ejected_at: ``time.monotonic()`` of its last ejection (0 = never ejected).
    """

    spec: BackendSpec
    up: bool = False
    fails: int = 0
    oks: int = 0
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    in_flight: int = 0
    running: int = 0
    waiting: int = 0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    block_size: int = 0
    hash_algo: str = ""
    kv_capacity: int = 0
    registered: bool = False
    listed: bool = True
    last_error: str = ""
    seen: float = 0.0
    ejected_at: float = 0.0
    checking: bool = False

    @property
    def id(self) -> str:
        """The instance id."""
        return self.spec.id

    def row(self) -> dict[str, object]:
        """The ``/backends`` row."""
        return {"id": self.id, "url": self.spec.url, "role": self.spec.role, "up": self.up,
                "in_flight": self.in_flight, "running": self.running, "waiting": self.waiting,
                "prefix_cache_queries": self.prefix_queries, "prefix_cache_hits": self.prefix_hits,
                "block_size": self.block_size, "hash_algo": self.hash_algo,
                "kv_capacity_tokens": self.kv_capacity, "events_indexed": self.registered,
                "last_error": self.last_error,
                "ejected_at": time.time() - (time.monotonic() - self.ejected_at) if self.ejected_at else None}


class GatewayPrefixes:
    """The policies' prefix source: the private conductor once the block size is known."""

    def __init__(self) -> None:
        self.inner: ConductorPrefixes | None = None

    def match(self, hash_ids: Sequence[int]) -> dict[str, Match]:
        """Per prefill instance prefix matches (none before the block size is known)."""
        if self.inner is None or not hash_ids:
            return {}
        return self.inner.match(hash_ids)


class BackendPool:
    """Backends, their health and load, and the index registrations of their KV events.

    Args:
        config: the router configuration.
        router: the scheduling router whose instance availability this pool drives.
        conductor: the private index the backends' KV events feed.
        prefixes: the policies' prefix source (filled once the block size is known).
        client: the shared HTTP client (each call passes its own timeout).
        on_block_size: called once with the block size when it is read from a backend.
    """

    def __init__(self, config: GatewayConfig, router: Router, conductor: Conductor,
                 prefixes: GatewayPrefixes, client: httpx.AsyncClient,
                 on_block_size: Callable[[int], None] | None = None) -> None:
        self.config, self.router, self.conductor = config, router, conductor
        self.on_block_size = on_block_size
        self.prefixes, self.client = prefixes, client
        self.model = config.model or CONTEXT_MODEL
        self.block_size = config.block_size
        self.backends: dict[str, Backend] = {}
        self._rr = itertools.count()
        self._tasks: set[asyncio.Future[None]] = set()
        self.watchers: dict[str, asyncio.Future[None]] = {}  # backend id -> its health loop
        self.discovery_errors = 0
        self.pools_registered: set[str] = set()  # shared pools indexed (``config.pools``)
        for spec in config.backends:
            self.add(spec)

    # membership --------------------------------------------------------------------------------
    def add(self, spec: BackendSpec) -> Backend:
        """Track a backend (out of rotation until its first good health check). Idempotent."""
        b = self.backends.get(spec.id)
        if b is not None:
            return b
        b = self.backends[spec.id] = Backend(spec)
        self.router.add_instance(spec.id, prefill=spec.role != "decode", decode=spec.role != "prefill")
        self.router.set_available(spec.id, False)
        instruments.BACKEND_UP.labels(spec.id).set(0)
        self._maybe_register(b)
        return b

    def get(self, backend_id: str) -> Backend:
        """The backend with this id (KeyError if unknown)."""
        return self.backends[backend_id]

    def healthy(self, role: str | None = None) -> list[Backend]:
        """Backends in rotation, optionally those able to serve ``role`` (prefill/decode)."""
        return [b for b in self.backends.values() if b.up and (
            role is None or b.spec.role in ("both", role))]

    def pick_any(self) -> Backend | None:
        """A healthy backend, round robin (for /tokenize and /v1/models)."""
        up = self.healthy()
        return up[next(self._rr) % len(up)] if up else None

    # ejection and admission ----------------------------------------------------------------------
    def eject(self, b: Backend, reason: str) -> None:
        """Take ``b`` out of rotation and abort what is in flight on it."""
        b.fails = max(b.fails, 1)
        b.oks = 0
        if not b.up:
            return
        b.up = False
        b.ejected_at = time.monotonic()
        b.gone.set()
        self.router.set_available(b.id, False)
        instruments.BACKEND_UP.labels(b.id).set(0)
        instruments.EJECTIONS.labels(b.id, reason).inc()
        kvlog.event("router_backend_ejected", backend=b.id, url=b.spec.url, reason=reason)
        log.warning("backend %s (%s) ejected: %s", b.id, b.spec.url, reason)

    def _admit(self, b: Backend) -> None:
        b.up = True
        b.gone = asyncio.Event()
        self.router.set_available(b.id, True)
        instruments.BACKEND_UP.labels(b.id).set(1)
        kvlog.event("router_backend_admitted", backend=b.id, url=b.spec.url)
        log.info("backend %s (%s) in rotation", b.id, b.spec.url)

    def record(self, b: Backend, ok: bool, refused: bool = False, error: str = "") -> None:
        """Apply one health-check (or passive) observation."""
        if ok:
            b.fails, b.oks = 0, b.oks + 1
            if not b.up and b.listed and b.oks >= self.config.admit_after:
                self._admit(b)
            return
        b.last_error = error
        b.oks, b.fails = 0, b.fails + 1
        if b.up:  # what led to an ejection, in the log (a backend out of rotation: quiet)
            log.info("backend %s failed a check (%d in a row): %s", b.id, b.fails, error)
        if refused:
            self.eject(b, "refused")
        elif b.fails >= self.config.eject_after:
            self.eject(b, "health")

    async def check(self, b: Backend) -> None:
        """One health check of ``b`` (GET /health with the health timeout).

        A check that times out while ``b`` keeps sending bytes on proxied calls is not counted: a
        loaded vLLM answers ``/health`` late but is alive (a killed one sends nothing more).
        """
        if b.checking:  # one check of a backend at a time (rounds and passive checks)
            return
        b.checking, started = True, time.monotonic()
        timeout = self.config.health_timeout_s
        try:  # httpx times each phase (connect, write, read); the check as a whole gets `timeout`
            r = await asyncio.wait_for(self.client.get(b.spec.url + "/health", timeout=timeout,
                                                       headers=self.headers()), timeout)
            ok, err = r.status_code == 200, f"HTTP {r.status_code}"
            self.record(b, ok, error="" if ok else err)
        except httpx.ConnectError as exc:
            self.record(b, False, refused=True, error=f"connect: {exc}")
        except (httpx.TimeoutException, asyncio.TimeoutError) as exc:
            if b.seen > started:
                b.last_error = f"health {type(exc).__name__} while streaming (not counted)"
                log.info("backend %s: %s", b.id, b.last_error)
                instruments.UPSTREAM_ERRORS.labels(b.id, "health_timeout_excused").inc()
            else:
                self.record(b, False, error=f"{type(exc).__name__}: {exc}")
        except httpx.HTTPError as exc:
            self.record(b, False, error=f"{type(exc).__name__}: {exc}")
        finally:
            b.checking = False

    def check_soon(self, b: Backend) -> None:
        """Check ``b`` now, off the round (a proxied call saw its connection drop)."""
        if b.up and not b.checking:
            task = asyncio.ensure_future(self.check(b))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def check_all(self) -> None:
        """Check every backend concurrently (once, before serving)."""
        await asyncio.gather(*(self.check(b) for b in list(self.backends.values())))

    async def watch_all(self) -> None:
        """Health-check every backend on its own cadence until cancelled (new ones as they come).

        One task per backend: a slow check of one never delays another's. Seen under load on the
        2-core test box: with one round for all, a live backend's 1.5 s check (0.5 s per phase)
        held back the next check of a killed one for 1.5 s.
        """
        watchers = self.watchers
        try:
            while True:
                for b in list(self.backends.values()):
                    if b.id not in watchers:
                        watchers[b.id] = asyncio.ensure_future(self._watch(b))
                await asyncio.sleep(self.config.health_interval_s)
        finally:  # not awaited here: the owner stops them (``stop_tasks``: they may need more)
            for t in watchers.values():
                t.cancel()

    def tasks(self) -> list[asyncio.Future[None]]:
        """The pool's running background tasks (health watchers, checks off the round)."""
        return [*self.watchers.values(), *self._tasks]

    async def _watch(self, b: Backend) -> None:
        """Check ``b`` every ``health_interval_s`` (start to start); a failing backend still in
        rotation is checked again after at most ``health_timeout_s``, so ``eject_after`` timeouts
        follow each other."""
        cfg = self.config
        failing = min(cfg.health_interval_s, cfg.health_timeout_s)
        await self.run(lambda: failing if b.up and b.fails else cfg.health_interval_s,
                       lambda: self.check(b), "health", b.id)

    def headers(self) -> dict[str, str]:
        """Headers of every upstream call (the shared token, when set)."""
        return {"Authorization": f"Bearer {self.config.token}"} if self.config.token else {}

    # scrapes --------------------------------------------------------------------------------------
    async def scrape(self, b: Backend) -> None:
        """Read ``b``'s /metrics (vLLM's names) into its record and the router's load view."""
        try:
            r = await self.client.get(b.spec.url + "/metrics", timeout=self.config.health_timeout_s * 2,
                                      headers=self.headers())
            r.raise_for_status()
            parse_vllm_metrics(r.text, b)
        except (httpx.HTTPError, ValueError) as exc:
            b.last_error = f"metrics: {type(exc).__name__}: {exc}"
            return
        self.router.observe(b.id, b.waiting, b.kv_capacity or None)
        for what, value in (("running", b.running), ("waiting", b.waiting)):
            instruments.BACKEND_QUEUE.labels(b.id, what).set(value)
        if not self.block_size and b.block_size:
            self.block_size = b.block_size
            log.info("block size %d read from %s", b.block_size, b.id)
            if self.on_block_size is not None:
                self.on_block_size(b.block_size)
        self._maybe_register(b)

    async def scrape_all(self) -> None:
        """Scrape every backend in rotation concurrently."""
        await asyncio.gather(*(self.scrape(b) for b in self.healthy()))

    def _register_pools(self) -> None:
        """Index the shared pools' KV events (``config.pools``) once the block size is known:
        their blocks count for every instance."""
        for p in self.config.pools:
            if p.id in self.pools_registered:
                continue
            try:
                self.conductor.register(Registration(
                    p.id, self.model, self.block_size, endpoint=p.events,
                    replay_endpoint=p.replay, type=p.type, token=p.token,
                    hash_profile=self.config.hash_profile))
                self.pools_registered.add(p.id)
            except KVPlaneError as exc:
                log.warning("cannot index KV events of pool %s: %s", p.id, exc)

    def _maybe_register(self, b: Backend) -> None:
        """Index ``b``'s KV events once the block size is known (prefill-capable backends),
        and the shared pools' with the first."""
        if self.block_size:
            self._register_pools()
        if b.registered or not self.block_size or b.spec.role == "decode":
            return
        if b.block_size and b.block_size != self.block_size:
            b.last_error = f"block size {b.block_size} != router's {self.block_size}: not indexed"
            return
        if self.prefixes.inner is None:
            self.prefixes.inner = ConductorPrefixes(self.conductor, self.model, self.block_size, [])
        if b.id not in self.prefixes.inner.instances:
            self.prefixes.inner.instances.append(b.id)
        if b.spec.events is None and not self.config.bind:
            return  # publishes nothing we can hear: routed cache-blind
        try:
            self.conductor.register(Registration(
                b.id, self.model, self.block_size, endpoint=b.spec.events,
                replay_endpoint=b.spec.replay, topic=b.spec.topic,
                hash_profile=self.config.hash_profile))
            b.registered = True
        except KVPlaneError as exc:
            b.last_error = f"index registration: {exc}"
            log.warning("cannot index KV events of %s: %s", b.id, exc)

    # discovery ------------------------------------------------------------------------------------
    async def discover(self, meta: MetadataBackend) -> int:
        """Read the backend list from the metadata service; add the new ones.

        Backends that leave the list are ejected (not forgotten: their index entries stay until
        their events say otherwise). Returns the number of records read.
        """
        try:
            raw = await asyncio.wait_for(asyncio.to_thread(
                meta.get, self.config.discover_key, self.config.connect_timeout_s),
                self.config.connect_timeout_s * 2)
            records = json.loads(raw) if raw else []
            specs = [BackendSpec.from_dict(r) for r in records]
        except (KVPlaneError, ValueError, TypeError, asyncio.TimeoutError) as exc:
            self.discovery_errors += 1
            log.warning("backend discovery from %s failed: %s", self.config.discover, exc)
            return -1
        pd = self.config.pd
        for spec in specs:
            if (spec.role == "both") == pd:
                log.warning("discovered backend %s has role %s, not usable by this %s router",
                            spec.id, spec.role, "PD" if pd else "colocated")
                continue
            self.add(spec)
        listed = {s.id for s in specs}
        for b in list(self.backends.values()):
            b.listed = b.id in listed or b.spec in self.config.backends
            if not b.listed:
                self.eject(b, "unlisted")
        return len(specs)

    # loops ----------------------------------------------------------------------------------------
    async def run(self, every: float | Callable[[], float], step: Callable[[], Awaitable[object]],
                  what: str, backend: str = "-") -> None:
        """Call ``await step()`` every ``every`` seconds (start to start; a callable is asked
        after each step) until cancelled."""
        while True:
            start = time.monotonic()
            try:
                await step()
            except Exception:  # a bug in one round must not stop the loop; logged, counted
                instruments.UPSTREAM_ERRORS.labels(backend, f"{what}_loop").inc()
                log.exception("router %s round failed (%s)", what, backend)
            gap = every() if callable(every) else every
            await asyncio.sleep(max(0.0, gap - (time.monotonic() - start)))


def parse_vllm_metrics(text: str, b: Backend) -> None:
    """Fill ``b``'s load and cache fields from vLLM's Prometheus exposition (summed over engines).

    Raises:
        ValueError: the text is not Prometheus exposition.
    """
    running = waiting = 0.0
    queries = hits = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "vllm:num_requests_running":
                running += s.value
            elif s.name == "vllm:num_requests_waiting":
                waiting += s.value
            elif s.name == "vllm:prefix_cache_queries_total":
                queries += s.value
            elif s.name == "vllm:prefix_cache_hits_total":
                hits += s.value
            elif s.name == "vllm:cache_config_info":
                b.block_size = _int(s.labels.get("block_size"), b.block_size)
                b.kv_capacity = _int(s.labels.get("kv_cache_size_tokens"), b.kv_capacity)
                b.hash_algo = s.labels.get("prefix_caching_hash_algo", b.hash_algo)
    b.running, b.waiting = int(running), int(waiting)
    b.prefix_queries, b.prefix_hits = queries, hits


def _int(text: str | None, default: int) -> int:
    try:
        return int(text) if text is not None else default
    except ValueError:
        return default
