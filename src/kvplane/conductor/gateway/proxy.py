"""The request path of ``kvplane router``: tokenize, hash, route, relay, retry, fail cleanly.

For each OpenAI request the :class:`Gateway` gets the prompt's token ids (given, or from a
backend's ``/tokenize``: the backend's own tokenizer and chat template), hashes its complete blocks
as vLLM does (``HashProfile``), asks the scheduling :class:`Router` (the shared policy over the
index fed by the backends' KV events) and relays the request:

* colocated: to the chosen instance; the first streamed event marks its prefill done.
* PD: a ``max_tokens=1`` prefill on the chosen prefill instance with
  ``kv_transfer_params={"do_remote_decode": true}``, then the request with the returned params on
  the chosen decode instance (the KV moves between them, never through the router).

Failures before the first token (refused or dropped connection, 5xx, ejection while waiting) are
retried on instances not tried yet, up to ``GatewayConfig.retries`` times (colocated and
prefill; a decode moves once); after the first token the stream ends with an SSE error event and
``[DONE]``. A 4xx from a backend is the client's answer. Every upstream call has a timeout.
Must not bind sockets.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvplane.common.errors import Unavailable
from kvplane.conductor.gateway import instruments
from kvplane.conductor.gateway.config import GatewayConfig
from kvplane.conductor.gateway.pool import Backend, BackendPool
from kvplane.conductor.gateway.relay import BackendGone, error_body, error_event, is_data, race, sse_events
from kvplane.conductor.scheduling.router import Router
from kvplane.conductor.scheduling.view import Decision, Request

log = logging.getLogger(__name__)
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}
CHAT_TOKENIZE_KEYS = ("add_generation_prompt", "continue_final_message", "add_special_tokens",
                      "chat_template", "chat_template_kwargs", "tools")
SSE = "text/event-stream"
# a connection closed under a request before any byte of the answer came back
DROPPED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
HASH_INLINE_TOKENS = 8192


class Retryable(Exception):
    """An upstream attempt failed before the first token; another backend may serve it."""

    def __init__(self, backend: Backend, kind: str, message: str) -> None:
        super().__init__(f"{backend.id}: {message}")
        self.backend, self.kind = backend, kind


class Final(Exception):
    """The upstream's own answer (4xx) goes to the client as it is."""

    def __init__(self, response: Response) -> None:
        super().__init__("client error")
        self.response = response


def _json_error(message: str, status: int, kind: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, kind), status, headers=headers)


class Gateway:
    """Routes and relays OpenAI requests over a :class:`BackendPool`.

    Args:
        config: the router configuration.
        pool: the backends.
        router: the scheduling router (policy + load bookkeeping + prefix source).
        client: the shared HTTP client.
    """

    def __init__(self, config: GatewayConfig, pool: BackendPool, router: Router,
                 client: httpx.AsyncClient) -> None:
        self.config, self.pool, self.router, self.client = config, pool, router, client
        self.profile = config.hash_profile
        self._rids = itertools.count(1)
        self._read = httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s)

    # request -> scheduling Request ------------------------------------------------------------
    async def tokens(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids: given ids, else the backend's ``/tokenize`` (None on failure)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]  # a batch: route by its first prompt
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if path.endswith("/chat/completions") or "messages" in body:
            ask = {"model": body.get("model"), "messages": body.get("messages")}
            ask.update({k: body[k] for k in CHAT_TOKENIZE_KEYS if k in body})
        elif isinstance(prompt, str):
            ask = {"model": body.get("model"), "prompt": prompt,
                   "add_special_tokens": body.get("add_special_tokens", True)}
        else:
            return None
        return await self._tokenize(ask)

    async def _tokenize(self, ask: dict[str, Any]) -> list[int] | None:
        b = self.pool.pick_any()
        if b is None:
            return None
        start = time.perf_counter()
        try:
            r = await self.client.post(b.spec.url + "/tokenize", json=ask, headers=self.pool.headers(),
                                       timeout=self.config.tokenize_timeout_s)
            tokens = r.json().get("tokens") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            tokens = None
        if not isinstance(tokens, list):
            instruments.TOKENIZE_ERRORS.inc()
            return None
        instruments.TOKENIZE_SECONDS.observe(time.perf_counter() - start)
        return tokens

    async def request_of(self, path: str, body: dict[str, Any]) -> Request:
        """The scheduling view of one request (hashes empty when tokens or block size are unknown)."""
        tokens = await self.tokens(path, body)
        bs = self.pool.block_size
        hashes: tuple[int, ...] = ()
        if tokens and bs:
            salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
            job = lambda: tuple(self.profile.event_hashes(tokens, bs, cache_salt=salt))  # noqa: E731
            # long prompts hash off the event loop (about 1.5 us per block, pure Python)
            hashes = job() if len(tokens) < HASH_INLINE_TOKENS else await asyncio.to_thread(job)
        length = len(tokens) if tokens else max(1, len(str(body.get("prompt") or body.get("messages"))) // 4)
        out = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        return Request(next(self._rids), time.monotonic(), length,
                       out if isinstance(out, int) else 16, hashes)

    # entry points ---------------------------------------------------------------------------------
    async def route_only(self, path: str, body: dict[str, Any]) -> Response:
        """``POST /route``: the decision for ``body``, nothing proxied and no load booked."""
        req = await self.request_of(path, body)
        try:
            d = self.router.decide(req)
        except Unavailable as exc:
            return _json_error(str(exc), 503, "unavailable")
        if d.rejected:
            return self._reject(d)
        answer: dict[str, Any] = {"prefix_blocks": d.prefix_blocks, "est_ttft_s": d.est_ttft_s,
                                  "est_tbt_s": d.est_tbt_s, "source": d.source,
                                  "prompt_tokens": req.input_length, "prompt_blocks": len(req.hash_ids)}
        for phase, inst in (("prefill", d.prefill), ("decode", d.decode)):
            b = self.pool.get(inst or "")
            answer[phase] = {"id": b.id, "url": b.spec.url}
        answer["backend"] = answer["decode" if self.config.pd else "prefill"]["url"]
        return JSONResponse(answer)

    async def serve(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        """Route and relay one OpenAI request (colocated or PD)."""
        start = time.perf_counter()
        req = await self.request_of(path, body)
        exclude: list[str] = []
        retries = self.config.retries
        last: Retryable | None = None
        while True:
            try:
                d = self.router.route(req, exclude)
            except Unavailable as exc:
                if last is not None:  # every backend still in rotation was tried
                    break
                instruments.FAILED.labels("unavailable").inc()
                return _json_error(str(exc), 503, "unavailable")
            if d.rejected:
                return self._reject(d)
            if not exclude:
                self._count(d, req, start)
            try:
                if self.config.pd:
                    return await self._serve_pd(path, body, headers, req, d)
                return await self._relay(self.pool.get(d.prefill or ""), path, body, headers,
                                         req.rid, colocated=True)
            except Final as exc:
                self.router.abandon(req.rid)
                return exc.response
            except Retryable as exc:
                self.router.abandon(req.rid)
                exclude.append(exc.backend.id)
                last = exc
                if retries == 0:
                    break
                retries -= 1
                instruments.RETRIES.labels("prefill" if self.config.pd else "both").inc()
                log.info("retrying request %d elsewhere: %s", req.rid, exc)
        instruments.FAILED.labels("upstream").inc()
        return _json_error(f"upstream failed before the first token: {last}", 502, "upstream_error")

    def _count(self, d: Decision, req: Request, start: float) -> None:
        instruments.ROUTE_SECONDS.observe(time.perf_counter() - start)
        instruments.PROMPT_BLOCKS.inc(len(req.hash_ids))
        if d.prefix_blocks:  # the policy looked (mooncake): no second walk of the index
            instruments.HIT_BLOCKS.inc(d.prefix_blocks)
        elif d.prefill is not None and req.hash_ids:
            m = self.router.prefixes.match(req.hash_ids).get(d.prefill)
            if m is not None:
                instruments.HIT_BLOCKS.inc(m.longest)

    def _reject(self, d: Decision) -> Response:
        instruments.REJECTED.labels(d.reject or "unknown").inc()
        return _json_error(f"rejected: predicted {d.reject} SLO miss (estimated TTFT "
                           f"{d.est_ttft_s}, TBT {d.est_tbt_s})", 429, "rejected",
                           {"Retry-After": str(self.config.retry_after_s)})

    # PD --------------------------------------------------------------------------------------------
    async def _serve_pd(self, path: str, body: dict[str, Any], headers: dict[str, str],
                        req: Request, d: Decision) -> Response:
        params = await self._prefill(self.pool.get(d.prefill or ""), path, body, headers)
        self.router.prefill_done(req.rid)
        second = {**body, "kv_transfer_params": params}
        dec = self.pool.get(d.decode or "")
        try:
            return await self._relay(dec, path, second, headers, req.rid, colocated=False)
        except Retryable as exc:  # the prefill is done: only the decode moves
            spare = [b for b in self.pool.healthy("decode") if b.id != dec.id]
            if not spare:
                raise Final(_json_error(f"decode failed before the first token: {exc}", 502,
                                        "upstream_error")) from exc
            instruments.RETRIES.labels("decode").inc()
            alt = min(spare, key=lambda b: b.in_flight)
            try:
                return await self._relay(alt, path, second, headers, req.rid, colocated=False)
            except Retryable as again:
                raise Final(_json_error(f"decode failed before the first token: {again}", 502,
                                        "upstream_error")) from again

    async def _prefill(self, b: Backend, path: str, body: dict[str, Any],
                       headers: dict[str, str]) -> dict[str, Any]:
        first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS}
        first.pop("stream_options", None)
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
        r = await self._call(b, path, first, headers, "prefill")
        try:
            params = r.json().get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        if not params:
            raise Final(_json_error(f"prefill {b.id} returned no kv_transfer_params (is it "
                                    "running KVPlanePDConnector?)", 502, "upstream_error"))
        return params

    # upstream calls -----------------------------------------------------------------------------
    def _headers(self, headers: dict[str, str]) -> dict[str, str]:
        out = self.pool.headers()
        if not out and headers.get("authorization"):
            out["Authorization"] = headers["authorization"]  # no router token: the client's
        if headers.get("x-request-id"):
            out["X-Request-Id"] = headers["x-request-id"]
        return out

    def _failed(self, b: Backend, exc: Exception, phase: str) -> Retryable:
        kind = "gone" if isinstance(exc, BackendGone) else type(exc).__name__
        instruments.UPSTREAM_ERRORS.labels(b.id, kind).inc()
        self._suspect(b, exc, phase)
        return Retryable(b, kind, f"{kind} {exc}".strip())

    def _suspect(self, b: Backend, exc: Exception, phase: str) -> None:
        """A refused connection ejects ``b``; a dropped one gets it checked now."""
        if isinstance(exc, httpx.ConnectError):
            self.pool.record(b, False, refused=True, error=f"{phase}: {exc}")
        elif isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
            self.pool.check_soon(b)

    async def _call(self, b: Backend, path: str, body: dict[str, Any], headers: dict[str, str],
                    phase: str) -> httpx.Response:
        """One non-streamed upstream call, bounded by ``request_timeout_s`` and ejection."""
        instruments.ROUTED.labels(b.id, phase).inc()
        b.in_flight += 1

        async def whole() -> httpx.Response:
            resp = await self._send(b, path, body, headers)
            try:
                await resp.aread()
            finally:
                await resp.aclose()
            return resp

        try:
            r = await race(asyncio.wait_for(whole(), self.config.request_timeout_s), b.gone)
        except (httpx.HTTPError, BackendGone, asyncio.TimeoutError) as exc:
            raise self._failed(b, exc, phase) from exc
        finally:
            b.in_flight -= 1
        b.seen = time.monotonic()
        if r.status_code >= 500:
            instruments.UPSTREAM_ERRORS.labels(b.id, f"http_{r.status_code}").inc()
            raise Retryable(b, "status", f"HTTP {r.status_code}: {r.text[:200]}")
        if r.status_code >= 400:
            raise Final(Response(r.content, r.status_code, media_type=r.headers.get("content-type")))
        return r

    async def _relay(self, b: Backend, path: str, body: dict[str, Any], headers: dict[str, str],
                     rid: int, colocated: bool) -> Response:
        """Serve the client from ``b`` (streamed or not); bookkeeping ends with the answer."""
        phase = "both" if colocated else "decode"
        if not body.get("stream"):
            r = await self._call(b, path, body, headers, phase)
            self.router.abandon(rid)  # finished: drop its booked load
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"),
                            headers={"x-kvplane-backend": b.id})
        resp, events, first = await self._open_stream(b, path, body, headers, phase)
        if colocated:
            self.router.prefill_done(rid)
        return StreamingResponse(self._rest(b, resp, events, first, rid), media_type=SSE,
                                 headers={"x-kvplane-backend": b.id})

    async def _open_stream(self, b: Backend, path: str, body: dict[str, Any],
                           headers: dict[str, str], phase: str
                           ) -> tuple[httpx.Response, AsyncIterator[bytes], bytes]:
        """Send a streamed request and wait for its first data event (the first token)."""
        instruments.ROUTED.labels(b.id, phase).inc()
        gone = b.gone
        b.in_flight += 1
        resp: httpx.Response | None = None
        try:
            resp = await race(self._send(b, path, body, headers), gone)
            if resp.status_code != 200:
                content = await race(asyncio.wait_for(resp.aread(), self.config.read_timeout_s), gone)
                if resp.status_code >= 500:
                    raise Retryable(b, "status", f"HTTP {resp.status_code}: {content[:200]!r}")
                raise Final(Response(content, resp.status_code,
                                     media_type=resp.headers.get("content-type")))
            events = sse_events(resp.aiter_bytes())
            while True:
                first = await race(events.__anext__(), gone)
                b.seen = time.monotonic()
                if is_data(first):
                    return resp, events, first
        except StopAsyncIteration as exc:
            await self._close(b, resp)
            raise Retryable(b, "empty", "stream ended before the first token") from exc
        except (httpx.HTTPError, BackendGone, asyncio.TimeoutError, ValueError) as exc:
            await self._close(b, resp)
            raise self._failed(b, exc, phase) from exc
        except (Retryable, Final, asyncio.CancelledError):
            await self._close(b, resp)
            raise

    async def _send(self, b: Backend, path: str, body: dict[str, Any],
                    headers: dict[str, str]) -> httpx.Response:
        """POST to ``b`` and return once its status line and headers are in (the body streams).

        A connection dropped before any answer is tried once more on a fresh connection to the
        same backend: most often it was a kept-alive connection whose idle timer closed it on the
        backend's side as the request went out (the router lets idle connections go after 2 s,
        ``UPSTREAM_KEEPALIVE_S``, before vLLM's 5 s; a backend with a shorter timer still meets
        this), so the backend never saw the request. A backend that is really down fails the
        second try too, and the caller's retry rules take over.
        """
        def request() -> httpx.Request:
            return self.client.build_request("POST", b.spec.url + path, json=body,
                                             headers=self._headers(headers), timeout=self._read)

        try:
            return await self.client.send(request(), stream=True)
        except DROPPED as exc:
            if b.gone.is_set():
                raise
            instruments.RECONNECTS.labels(b.id).inc()
            log.info("%s dropped a request before answering (%s %s); once more on a fresh "
                     "connection", b.id, type(exc).__name__, exc)
            return await self.client.send(request(), stream=True)

    async def _close(self, b: Backend, resp: httpx.Response | None) -> None:
        b.in_flight -= 1
        if resp is not None:
            await resp.aclose()

    async def _rest(self, b: Backend, resp: httpx.Response, events: AsyncIterator[bytes],
                    first: bytes, rid: int) -> AsyncIterator[bytes]:
        """Relay the stream after its first event; a failure becomes an SSE error event.

        Ejection ends the stream only if it also stalls: each read after it gets
        ``stream_grace_s`` to arrive (a slow ``/health`` is not a dead stream).
        """
        gone = b.gone
        try:
            yield first
            while True:
                try:  # after an ejection the stream goes on while tokens keep coming
                    event = await race(events.__anext__(), gone, self.config.stream_grace_s)
                except StopAsyncIteration:
                    return
                b.seen = time.monotonic()
                yield event
        except (httpx.HTTPError, BackendGone, ValueError) as exc:
            kind = "gone" if isinstance(exc, BackendGone) else type(exc).__name__
            self._suspect(b, exc, "stream")
            instruments.STREAM_ERRORS.labels(kind).inc()
            instruments.UPSTREAM_ERRORS.labels(b.id, kind).inc()
            log.warning("stream from %s broke after the first token: %s %s", b.id, kind, exc)
            yield error_event(f"backend {b.id} failed mid-stream: {kind} {exc}".strip())
        finally:
            self.router.abandon(rid)
            await self._close(b, resp)
