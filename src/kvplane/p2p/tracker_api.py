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
    Conflict,
    InvalidArgument,
    KVPlaneError,
    NotFound,
    ProtocolError,
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
    """Add the ``/p2p`` routes to ``app``; returns the tracker behind them.

    Every route authenticates, runs lazy collection, parses its body (POST), calls the state
    machine with errors mapped to HTTP statuses, and wakes the long-polls when state changed.
    """
    trk = tracker or Tracker()
    st = trk.state
    now = time.monotonic

    async def claim(req: wire.ClaimReq) -> Any:
        return await trk.claim(req)

    def close(req: wire.CloseReq) -> dict[str, str]:
        st.close(req.name, req.version, req.reader)
        return {"status": "ok"}

    def remove(name: str) -> dict[str, str]:
        st.remove(name)
        return {"status": "ok"}

    posts: list[tuple[str, type[Any], Callable[[Any], Any], bool]] = [
        ("publish", wire.PublishReq,
         lambda r: {"version": st.publish(r.manifest, r.holder, r.addrs, now())}, True),
        ("open", wire.OpenReq, lambda r: st.open(r.name, r.version, r.reader, now()), False),
        ("claim", wire.ClaimReq, claim, False),
        ("close", wire.CloseReq, close, True),
        ("withdraw", wire.WithdrawReq,
         lambda r: {"withdrawn": st.withdraw(r.name, r.version, r.holder)}, True),
        ("heartbeat", wire.HeartbeatReq,
         lambda r: wire.HeartbeatResp(st.heartbeat(r.holder, r.holdings, now(), r.reading)),
         True),
    ]
    for path, typ, fn, changes in posts:
        _post(app, trk, auth, path, typ, fn, changes)
    TokenH = Header(None, alias="X-KVPlane-Token")
    NameQ = Query(..., min_length=1, max_length=256)

    @app.get(f"{wire.PREFIX}/objects")
    async def ls(prefix: str = Query("", max_length=256), x_token: str | None = TokenH) -> Response:
        return await _call(trk, auth, x_token, lambda: st.ls(prefix), False)

    @app.delete(f"{wire.PREFIX}/objects")
    async def rm(name: str = NameQ, x_token: str | None = TokenH) -> Response:
        return await _call(trk, auth, x_token, lambda: remove(name), True)

    @app.get(f"{wire.PREFIX}/status")
    async def status(name: str = NameQ, version: int = 0, x_token: str | None = TokenH) -> Response:
        return await _call(trk, auth, x_token, lambda: st.status(name, version), False)

    return trk


async def _call(trk: Tracker, auth: Callable[[str | None], None], token: str | None,
                fn: Callable[[], Any], changes: bool) -> Response:
    """Authenticate, collect, run ``fn`` (sync or async) with errors mapped, wake waiters."""
    auth(token)
    trk.gc()
    try:
        out = fn()
        if asyncio.iscoroutine(out):
            out = await out
    except KVPlaneError as exc:
        raise _fail(exc) from exc
    if changes:
        trk.changed()
    return _json(out)


def _post(app: FastAPI, trk: Tracker, auth: Callable[[str | None], None], path: str,
          typ: type[Any], fn: Callable[[Any], Any], changes: bool) -> None:
    async def route(request: Request,
                    x_token: str | None = Header(None, alias="X-KVPlane-Token")) -> Response:
        auth(x_token)
        req = await _body(request, typ)
        return await _call(trk, lambda _: None, None, lambda: fn(req), changes)

    app.add_api_route(f"{wire.PREFIX}/{path}", route, methods=["POST"], name=f"p2p_{path}")
