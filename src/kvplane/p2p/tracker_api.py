"""The P2P tracker over HTTP: routes under ``/p2p`` mounted into ``kvplane metadata``.

``mount(app, auth)`` adds the routes to a FastAPI app (the metadata server calls it through
its ``plugins`` argument, so ``kvplane.transfer`` never imports ``kvplane.p2p``). Every route
takes the shared token (``auth``). The state lives in one :class:`TrackerState` used only from
the event loop (every route is ``async``), so it needs no lock. A claim that finds nothing to
assign waits (long-poll, at most ``wait`` seconds) for the swarm to change.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
from fastapi import FastAPI, Header, HTTPException, Query, Request, Response

from kvplane.common.errors import (
    Conflict, InvalidArgument, KVPlaneError, NotFound, ProtocolError,
)
from kvplane.p2p import wire
from kvplane.p2p.tracker import TrackerState

T = TypeVar("T")
MAX_WAIT = 5.0
GC_EVERY = 0.2
_STATUS = {NotFound: 404, Conflict: 409, InvalidArgument: 400, ProtocolError: 400}


def _json(obj: Any) -> Response:
    return Response(msgspec.json.encode(obj), media_type="application/json")


def _fail(exc: KVPlaneError) -> HTTPException:
    for cls, code in _STATUS.items():
        if isinstance(exc, cls):
            return HTTPException(code, str(exc))
    return HTTPException(500, str(exc))


async def _body(request: Request, typ: type[T]) -> T:
    if int(request.headers.get("content-length") or 0) > wire.MAX_BODY:
        raise HTTPException(413, "request body too large")
    data = await request.body()
    try:
        return msgspec.json.decode(data, type=typ)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise HTTPException(400, f"malformed request: {exc}") from exc


class Tracker:
    """A TrackerState plus the event the long-polls wait on and lazy collection."""

    def __init__(self, state: TrackerState | None = None) -> None:
        self.state = state or TrackerState()
        self._changed = asyncio.Event()
        self._gc_at = 0.0

    def changed(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def gc(self) -> None:
        now = time.monotonic()
        if now - self._gc_at >= GC_EVERY:
            self._gc_at = now
            if self.state.expire(now):
                self.changed()

    async def claim(self, req: wire.ClaimReq) -> wire.ClaimResp:
        """Record and assign; with nothing to assign, wait for a change up to ``req.wait``."""
        deadline = time.monotonic() + min(max(req.wait, 0.0), MAX_WAIT)
        first = True
        while True:
            ev = self._changed
            c = self.state.claim(req.name, req.version, req.reader, now=time.monotonic(),
                                 addrs=req.addrs if first else None,
                                 done=req.done if first else [],
                                 failed=req.failed if first else [],
                                 want=req.want, strategy=req.strategy)
            if first and (req.done or req.failed):
                self.changed()
            first = False
            left = deadline - time.monotonic()
            if c.assign or c.left == 0 or c.unavailable or req.want <= 0 or left <= 0:
                return wire.ClaimResp(c.assign, c.left, c.unavailable)
            try:
                await asyncio.wait_for(ev.wait(), left)
            except asyncio.TimeoutError:
                pass


def mount(app: FastAPI, auth: Callable[[str | None], None], tracker: Tracker | None = None) -> Tracker:
    """Add the ``/p2p`` routes to ``app``; returns the tracker behind them."""
    trk = tracker or Tracker()
    st = trk.state
    P = wire.PREFIX
    TokenH = Header(None, alias="X-KVPlane-Token")

    def guard(token: str | None) -> None:
        auth(token)
        trk.gc()

    @app.post(f"{P}/publish")
    async def publish(request: Request, x_token: str | None = TokenH) -> Response:
        guard(x_token)
        req = await _body(request, wire.PublishReq)
        try:
            version = st.publish(req.manifest, req.holder, req.addrs, time.monotonic())
        except KVPlaneError as exc:
            raise _fail(exc) from exc
        trk.changed()
        return _json({"version": version})

    @app.post(f"{P}/open")
    async def open_(request: Request, x_token: str | None = TokenH) -> Response:
        guard(x_token)
        req = await _body(request, wire.OpenReq)
        try:
            return _json(st.open(req.name, req.version, req.reader, time.monotonic()))
        except KVPlaneError as exc:
            raise _fail(exc) from exc

    @app.post(f"{P}/claim")
    async def claim(request: Request, x_token: str | None = TokenH) -> Response:
        guard(x_token)
        req = await _body(request, wire.ClaimReq)
        try:
            return _json(await trk.claim(req))
        except KVPlaneError as exc:
            raise _fail(exc) from exc

    @app.post(f"{P}/close")
    async def close(request: Request, x_token: str | None = TokenH) -> Response:
        guard(x_token)
        req = await _body(request, wire.CloseReq)
        st.close(req.name, req.version, req.reader)
        trk.changed()
        return _json({"status": "ok"})

    @app.post(f"{P}/withdraw")
    async def withdraw(request: Request, x_token: str | None = TokenH) -> Response:
        guard(x_token)
        req = await _body(request, wire.WithdrawReq)
        try:
            n = st.withdraw(req.name, req.version, req.holder)
        except KVPlaneError as exc:
            raise _fail(exc) from exc
        trk.changed()
        return _json({"withdrawn": n})

    @app.post(f"{P}/heartbeat")
    async def heartbeat(request: Request, x_token: str | None = TokenH) -> Response:
        guard(x_token)
        req = await _body(request, wire.HeartbeatReq)
        drop = st.heartbeat(req.holder, req.holdings, time.monotonic())
        trk.changed()
        return _json(wire.HeartbeatResp(drop))

    @app.get(f"{P}/objects")
    async def ls(prefix: str = Query("", max_length=256), x_token: str | None = TokenH) -> Response:
        guard(x_token)
        return _json(st.ls(prefix))

    @app.delete(f"{P}/objects")
    async def rm(name: str = Query(..., min_length=1, max_length=256),
                 x_token: str | None = TokenH) -> Response:
        guard(x_token)
        try:
            st.remove(name)
        except KVPlaneError as exc:
            raise _fail(exc) from exc
        trk.changed()
        return _json({"status": "ok"})

    @app.get(f"{P}/status")
    async def status(name: str = Query(..., min_length=1, max_length=256), version: int = 0,
                     x_token: str | None = TokenH) -> Response:
        guard(x_token)
        try:
            return _json(st.status(name, version))
        except KVPlaneError as exc:
            raise _fail(exc) from exc

    return trk
