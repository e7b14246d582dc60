"""``kvplane pd-proxy``: one OpenAI-compatible endpoint over X prefill and Y decode vLLM instances.

Each completion is sent first to a prefill instance (round robin) with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true}``; the ``kv_transfer_params`` it returns (where
its KV blocks are) go with the original request to a decode instance (round robin), whose answer
(streamed or not) is the client's. The instances run ``KVPlanePDConnector``. Only HTTP here:
the KV moves between the instances through the kvplane transfer engine, never through the proxy.
"""

# no `from __future__ import annotations`: FastAPI resolves the handlers' annotations at runtime
import contextlib
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import typer

from kvplane.cli.lifecycle import no_auth_option, resolve_token, token_option

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}


class PDRouter:
    """Picks instances round robin and relays one request as prefill, then decode.

    Args:
        prefill: base URLs of prefill instances.
        decode: base URLs of decode instances.
        timeout: seconds for one upstream request.
        transport: an httpx transport (tests pass a mock; default: the network).
    """

    def __init__(self, prefill: list[str], decode: list[str], timeout: float,
                 transport: Any = None) -> None:
        import httpx

        self.prefill, self.decode = prefill, decode
        self._pick_p, self._pick_d = itertools.cycle(prefill), itertools.cycle(decode)
        self.client = httpx.AsyncClient(timeout=timeout, trust_env=False, transport=transport)

    async def relay(self, path: str, body: dict[str, Any]) -> Any:
        """Prefill on one instance, decode (streamed if asked) on another; returns a Response."""
        import httpx
        from fastapi.responses import JSONResponse, Response, StreamingResponse

        p_url, d_url = next(self._pick_p), next(self._pick_d)
        first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS}
        first.pop("stream_options", None)
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
        try:
            r = await self.client.post(p_url + path, json=first)
        except httpx.HTTPError as exc:
            return JSONResponse({"error": f"prefill {p_url} unreachable: {exc}"}, 502)
        if r.status_code != 200:
            return Response(r.content, r.status_code, media_type="application/json")
        params = r.json().get("kv_transfer_params")
        if not params:
            return JSONResponse({"error": f"prefill {p_url} returned no kv_transfer_params "
                                          "(is it running KVPlanePDConnector?)"}, 502)
        second = {**body, "kv_transfer_params": params}
        if body.get("stream"):
            return StreamingResponse(self._stream(d_url + path, second),
                                     media_type="text/event-stream")
        try:
            r = await self.client.post(d_url + path, json=second)
        except httpx.HTTPError as exc:
            return JSONResponse({"error": f"decode {d_url} unreachable: {exc}"}, 502)
        return Response(r.content, r.status_code, media_type="application/json")

    async def _stream(self, url: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
        async with self.client.stream("POST", url, json=body) as r:
            async for chunk in r.aiter_bytes():
                yield chunk


def build_app(prefill: list[str], decode: list[str], timeout: float, transport: Any = None) -> Any:
    """The FastAPI app: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``."""
    from fastapi import FastAPI, Request, Response

    router = PDRouter(prefill, decode, timeout, transport)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await router.client.aclose()

    app = FastAPI(title="kvplane pd-proxy", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.relay("/v1/completions", await request.json())  # type: ignore[no-any-return]

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await router.relay("/v1/chat/completions", await request.json())  # type: ignore[no-any-return]

    @app.get("/v1/models")
    async def models() -> Response:
        r = await router.client.get(decode[0] + "/v1/models")
        return Response(r.content, r.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "prefill": prefill, "decode": decode}

    return app


def pd_proxy(
    prefill: list[str] = typer.Option(..., "--prefill", help="Prefill instance base URL (repeat for X)."),
    decode: list[str] = typer.Option(..., "--decode", help="Decode instance base URL (repeat for Y)."),
    host: str = typer.Option("127.0.0.1", help="Bind address."),
    port: int = typer.Option(8000, help="Port (0 picks a free one; the ready line says which)."),
    timeout: float = typer.Option(300.0, help="Seconds for one upstream request."),
    token: str = token_option(),
    no_auth: bool = no_auth_option("the OpenAI endpoints (/v1/completions, "
                                   "/v1/chat/completions, /v1/models): anyone could run "
                                   "requests on the instances behind it"),
) -> None:
    """Serve X prefill + Y decode vLLM instances (KVPlanePDConnector) behind one endpoint.

    Clients send the token as ``Authorization: Bearer TOKEN`` (an OpenAI client's api_key) or
    ``X-KVPlane-Token``; ``/health`` is open. Prints one JSON line ``{"proxy": URL}`` once
    listening.
    """
    import asyncio

    from kvplane.common.auth import token_authenticator
    from kvplane.common.http import GuardedServer

    tok = resolve_token(token, no_auth)
    strip = [u.rstrip("/") for u in prefill], [u.rstrip("/") for u in decode]
    app = build_app(strip[0], strip[1], timeout)
    server = GuardedServer(app, host, port, token_authenticator(tok), "pd-proxy", lifespan="on")
    typer.echo(json.dumps({"proxy": f"http://{host}:{server.port}"}))
    asyncio.run(server.serve())


def register(app: typer.Typer) -> None:
    """Add ``pd-proxy`` to the kvplane CLI."""
    app.command("pd-proxy")(pd_proxy)


if __name__ == "__main__":
    typer.run(pd_proxy)
