"""The master's admin HTTP API (Mooncake's routes), scoped by the caller's principal.

Served behind the token gate of ``kvplane.common.http``: every route but ``/health`` needs a
token. Keys are listed and queried in the caller's own tenant; the admin token may name
another with ``?tenant=``. Segment routes (which show addresses and endpoints) are for the
default tenant's tokens; only the admin sees which client owns a segment. Read-only: no
leases are taken.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, HTTPException, Query, Request

from kvplane.common import metrics
from kvplane.common.auth import ADMIN, DEFAULT_TENANT, Principal
from kvplane.common.errors import KVPlaneError
from kvplane.common.http_guard import principal_of
from kvplane.store.master import dashboard
from kvplane.store.master.access import check_tenant, keys_of, scoped
from kvplane.store.master.state import MasterState


def _who(request: Request) -> Principal:
    return principal_of(request) or ADMIN  # no gate in front (tests): open


def _tenant(request: Request, asked: str | None) -> str:
    who = _who(request)
    if asked is None or asked == who.tenant:
        return who.tenant
    if not who.admin:
        raise HTTPException(403, detail="only the admin token may name another tenant")
    try:
        return asked if asked == DEFAULT_TENANT else check_tenant(asked)
    except KVPlaneError as exc:
        raise HTTPException(400, detail=str(exc)) from exc


def _infra(request: Request) -> Principal:
    who = _who(request)
    if who.tenant != DEFAULT_TENANT:
        raise HTTPException(403, detail="segment views need the service or admin token")
    return who


def build(state_of: Callable[[], MasterState], lock: threading.Lock,
          status: Callable[[bool, bool], dict[str, Any]] | None = None,
          ha_status: Callable[[], dict[str, Any]] | None = None) -> FastAPI:
    """The admin app over ``state_of()`` (read under ``lock``; an HA master switches its state
    when it wins or loses the lead). ``status(admin, with_history)`` serves ``/status`` and
    ``/dashboard`` (``kvplane.store.master.dashboard``); ``ha_status()``: the role, for
    ``/health`` and ``/ha_status``."""
    app = FastAPI(title="kvplane master", version="1")

    def role_of() -> dict[str, Any]:
        return ha_status() if ha_status is not None else {"role": "leader"}

    @app.get("/health")
    def health() -> dict[str, Any]:
        state, role = state_of(), role_of()["role"]
        return {"status": "ok", "role": role, "ready": role == "leader",
                "keys": len(state.objects), "segments": len(state.segments)}

    @app.get("/ha_status")
    def ha() -> dict[str, Any]:
        return role_of()

    if status is not None:
        dashboard.install(app, status, _infra)
    _key_routes(app, state_of, lock)
    _segment_routes(app, state_of, lock)
    metrics.add_route(app)  # no 307 to /metrics/: plain curl prints it
    return app


def _key_routes(app: FastAPI, state_of: Callable[[], MasterState], lock: threading.Lock) -> None:
    TenantQ = Query(None, max_length=64, description="tenant to look in (admin token only)")

    @app.get("/query_key")
    def query_key(request: Request, key: str = Query(..., max_length=4096),
                  tenant: str | None = TenantQ) -> dict[str, Any]:
        try:
            internal = scoped(_tenant(request, tenant), key)
        except KVPlaneError as exc:
            raise HTTPException(400, detail=str(exc)) from exc
        with lock:
            state = state_of()
            obj = state.objects.get(internal)
            if obj is None or not obj.complete:
                raise HTTPException(404, detail={"error_code": -704})
            data = [{"size_": obj.size, "buffer_address_": r.addr, "protocol_": "tcp",
                     "transport_endpoint_": r.endpoint, "segment": r.segment}
                    for r in obj.replicas_of(state.segments)]
        return {"success": True, "data": data}

    @app.get("/get_all_keys")
    def all_keys(request: Request, limit: int = Query(10000, ge=1, le=1_000_000),
                 tenant: str | None = TenantQ) -> list[str]:
        name = _tenant(request, tenant)
        with lock:
            state = state_of()
            out: list[str] = []
            for internal, key in keys_of(state.objects, name):
                if len(out) >= limit:
                    break
                if state.objects[internal].complete:
                    out.append(key)
            return out


def _segment_routes(app: FastAPI, state_of: Callable[[], MasterState],
                    lock: threading.Lock) -> None:
    @app.get("/get_all_segments")
    def all_segments(request: Request) -> list[str]:
        _infra(request)
        with lock:
            return list(state_of().segments)

    @app.get("/segments")
    def segments(request: Request) -> list[dict[str, Any]]:
        admin = _infra(request).admin
        with lock:
            state = state_of()
            return [{"segment_name": n, "base_address": s.info.base,
                     **({"client_id": s.info.client_id} if admin else {}),
                     "size_bytes": s.info.size, "te_endpoint": s.info.endpoint,
                     "allocator_used_bytes": s.alloc.used,
                     "allocator_capacity_bytes": s.alloc.capacity,
                     "allocator_usage_percent": round(100 * s.alloc.used / s.alloc.capacity, 2)}
                    for n, s in state.segments.items()]

    app.add_api_route("/get_segments_detail", segments, methods=["GET"])
