"""HTTP API of ``kvplane router`` (FastAPI): the OpenAI surface, ``/route``, health and metrics.

Endpoints: ``POST /v1/completions`` and ``/v1/chat/completions`` (proxied, SSE relayed event by
event), ``GET /v1/models`` (from a backend), ``POST /route`` (the decision only, the way llm-d's
endpoint picker answers), ``GET /backends`` (the router's view of each backend), ``GET /health``
(no token; 503 while no backend can serve) and ``GET /metrics`` (Prometheus). With a token set,
every endpoint but ``/health`` needs ``Authorization: Bearer <token>`` or ``X-KVPlane-Token``.
Bodies over ``max_request_bytes`` get 413.

Must not bind sockets (``server.py`` does).
"""

from __future__ import annotations

import hmac
import json
from typing import Any

import httpx
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse, Response

from kvplane.common import metrics as common_metrics
from kvplane.conductor.gateway import instruments
from kvplane.conductor.gateway.proxy import Gateway
from kvplane.conductor.gateway.relay import error_body


async def _body(request: Request, limit: int) -> dict[str, Any] | JSONResponse:
    """The JSON object of the request, or the error answer (413 too large, 400 not an object)."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        return JSONResponse(error_body("request body too large", 413, "invalid_request_error"), 413)
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            return JSONResponse(error_body("request body too large", 413, "invalid_request_error"), 413)
    try:
        body = json.loads(data)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return JSONResponse(error_body("the body must be a JSON object", 400,
                                       "invalid_request_error"), 400)
    return body


def create_app(gateway: Gateway) -> FastAPI:
    """Build the router's app around ``gateway`` (token and limits from its config)."""
    cfg = gateway.config
    app = FastAPI(title="kvplane router", version="1",
                  description="Cache-aware OpenAI gateway in front of vLLM instances.")

    def auth(authorization: str | None = Header(None),
             x_kvplane_token: str | None = Header(None)) -> None:
        """Require the shared token (``Authorization: Bearer`` or ``X-KVPlane-Token``) if set."""
        if not cfg.token:
            return
        given = x_kvplane_token or (authorization or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), cfg.token.encode()):
            raise HTTPException(401, "missing or wrong token")

    guarded = [Depends(auth)]
    _openai_routes(app, gateway, guarded)
    _ops_routes(app, gateway, guarded)
    return app


def _openai_routes(app: FastAPI, gateway: Gateway, guarded: list[Any]) -> None:
    cfg, pool = gateway.config, gateway.pool

    async def proxied(request: Request, path: str) -> Response:
        body = await _body(request, cfg.max_request_bytes)
        if isinstance(body, Response):
            return body
        return await gateway.serve(path, body, {k.lower(): v for k, v in request.headers.items()})

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request) -> Response:
        """OpenAI completions, routed and relayed (streamed when ``stream`` is true)."""
        return await proxied(request, "/v1/completions")

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat(request: Request) -> Response:
        """OpenAI chat completions, routed and relayed (streamed when ``stream`` is true)."""
        return await proxied(request, "/v1/chat/completions")

    @app.post("/route", dependencies=guarded)
    async def route(request: Request) -> Response:
        """The chosen backend(s) for an OpenAI body, without proxying or booking load."""
        body = await _body(request, cfg.max_request_bytes)
        if isinstance(body, Response):
            return body
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        return await gateway.route_only(path, body)

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> Response:
        """The model list of a healthy backend."""
        b = pool.pick_any()
        if b is None:
            return JSONResponse(error_body("no backend is available", 503, "unavailable"), 503)
        try:
            r = await gateway.client.get(b.spec.url + "/v1/models", headers=pool.headers(),
                                         timeout=cfg.connect_timeout_s + cfg.health_timeout_s)
        except httpx.HTTPError as exc:
            return JSONResponse(error_body(f"backend {b.id}: {exc}", 502, "upstream_error"), 502)
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))


def _ops_routes(app: FastAPI, gateway: Gateway, guarded: list[Any]) -> None:
    cfg, pool = gateway.config, gateway.pool

    # async handlers: they read the pool, which only the event loop changes
    @app.get("/backends", dependencies=guarded)
    async def backends() -> list[dict[str, Any]]:
        """Every backend: health, the router's and the engine's load, cache counters."""
        prefill, _ = gateway.router.loads()
        queue = {p.instance: (p.queue_s, p.queued) for p in prefill}
        return [{**b.row(), "predicted_queue_s": queue.get(b.id, (0.0, 0))[0],
                 "queued_prefill": queue.get(b.id, (0.0, 0))[1]} for b in pool.backends.values()]

    @app.get("/health")
    async def health() -> Response:
        """``ok`` while the backends needed for a request are up (503 ``unavailable`` else)."""
        roles = ("prefill", "decode") if cfg.pd else (None,)
        serving = all(pool.healthy(r) for r in roles)
        index = gateway.pool.conductor.health()
        status = ("ok" if index["status"] == "ok" else "degraded") if serving else "unavailable"
        return JSONResponse({"status": status, "policy": cfg.policy, "mode": "pd" if cfg.pd else "colocated",
                             "backends_up": len(pool.healthy()), "backends": len(pool.backends),
                             "block_size": pool.block_size, "index": index},
                            200 if serving else 503)

    @app.get("/metrics", dependencies=guarded)
    async def metrics() -> Response:
        """Prometheus exposition: routed, rejected, hit blocks, per-backend queue, ..."""
        prefill, _ = gateway.router.loads()
        for p in prefill:
            instruments.BACKEND_QUEUE.labels(p.instance, "predicted_queue_s").set(p.queue_s)
            instruments.BACKEND_QUEUE.labels(p.instance, "queued_prefill").set(p.queued)
        for b in pool.backends.values():
            instruments.BACKEND_QUEUE.labels(b.id, "in_flight").set(b.in_flight)
        instruments.SLOWDOWN.set(gateway.router.slowdown)
        body, ctype = common_metrics.render()
        return Response(body, media_type=ctype)
