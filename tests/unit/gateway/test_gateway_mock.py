"""The router's PD choreography and colocated relay against mocked instances (httpx MockTransport),
the app driven in process (ASGI): what `kvplane pd-proxy` did, now done by the router."""

from __future__ import annotations

import contextlib
import json

import httpx
import pytest

from kvplane.conductor.gateway.config import BackendSpec, GatewayConfig
from kvplane.conductor.gateway.server import GatewayServer

pytestmark = pytest.mark.timeout(20)
METRICS = 'vllm:cache_config_info{block_size="2",kv_cache_size_tokens="64"} 1.0\n'


@contextlib.asynccontextmanager
async def router_with(upstream, pd: bool = True, **kw):
    """The router app in process, its upstream instances mocked; health checked once."""

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/health":
            return httpx.Response(200)
        if req.url.path == "/metrics":
            return httpx.Response(200, text=METRICS)
        return upstream(req)

    if pd:
        specs = (BackendSpec("http://p1", "prefill"), BackendSpec("http://p2", "prefill"),
                 BackendSpec("http://d1", "decode"))
    else:
        specs = (BackendSpec("http://e1"), BackendSpec("http://e2"))
    cfg = GatewayConfig(port=0, mode="pd" if pd else "colocated", backends=specs, **kw)
    server = GatewayServer(cfg, transport=httpx.MockTransport(handler))
    try:
        await server.pool.check_all()
        await server.pool.scrape_all()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app),
                                     base_url="http://router") as client:
            yield client
    finally:
        await server.client.aclose()
        server.close()


async def test_pd_prefills_then_decodes_with_the_returned_params():
    seen = []

    def upstream(req: httpx.Request) -> httpx.Response:
        body = json.loads(req.content)
        seen.append((req.url.host, body))
        if req.url.host.startswith("p"):
            return httpx.Response(200, json={"choices": [{"text": "x"}],
                                             "kv_transfer_params": {"remote_block_ids": [1]}})
        return httpx.Response(200, json={"choices": [{"token_ids": [4, 5]}]})

    async with router_with(upstream, policy="round-robin") as client:
        for _ in range(2):
            r = await client.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 5})
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [4, 5]
            assert r.headers["x-kvplane-backend"] == "d1"
    assert [h for h, _ in seen] == ["p1", "d1", "p2", "d1"]
    p_body, d_body = seen[0][1], seen[1][1]
    assert p_body["max_tokens"] == 1 and p_body["kv_transfer_params"]["do_remote_decode"] is True
    assert p_body["stream"] is False
    assert d_body["max_tokens"] == 5 and d_body["kv_transfer_params"] == {"remote_block_ids": [1]}


async def test_pd_streams_the_decode_answer_and_reports_a_prefill_without_params():
    def upstream(req: httpx.Request) -> httpx.Response:
        if req.url.host.startswith("p"):
            return httpx.Response(200, json={"kv_transfer_params": {"a": 1}})
        return httpx.Response(200, content=b"data: 1\n\ndata: [DONE]\n\n")

    async with router_with(upstream) as client:
        r = await client.post("/v1/completions", json={"prompt": [1], "stream": True})
        assert r.status_code == 200 and r.text == "data: 1\n\ndata: [DONE]\n\n"

    async with router_with(lambda req: httpx.Response(200, json={"choices": []})) as client:
        r = await client.post("/v1/chat/completions", json={"messages": []})
        assert r.status_code == 502 and "no kv_transfer_params" in r.json()["error"]["message"]


async def test_pd_prefill_failure_is_retried_on_the_other_prefill_instance():
    seen = []

    def upstream(req: httpx.Request) -> httpx.Response:
        seen.append(req.url.host)
        if req.url.host == "p1":
            raise httpx.ConnectError("refused")
        if req.url.host == "p2":
            return httpx.Response(200, json={"kv_transfer_params": {"a": 1}})
        return httpx.Response(200, json={"ok": True})

    async with router_with(upstream, policy="round-robin") as client:
        r = await client.post("/v1/completions", json={"prompt": [1, 2, 3]})
        assert r.status_code == 200 and r.json() == {"ok": True}
    assert seen == ["p1", "p2", "d1"]


async def test_colocated_prompt_ids_are_hashed_and_text_is_tokenized_by_a_backend():
    asked = []

    def upstream(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/tokenize":
            asked.append(json.loads(req.content))
            return httpx.Response(200, json={"tokens": [7, 8, 9, 10, 11]})
        return httpx.Response(200, json={"choices": [{"text": "y"}]})

    async with router_with(upstream, pd=False) as client:
        route = (await client.post("/route", json={"model": "m", "prompt": [1, 2, 3, 4, 5]})).json()
        assert route["prompt_tokens"] == 5 and route["prompt_blocks"] == 2 and not asked
        route = (await client.post("/route", json={"model": "m", "prompt": "hello there"})).json()
        assert route["prompt_blocks"] == 2
        assert asked == [{"model": "m", "prompt": "hello there", "add_special_tokens": True}]
        long = (await client.post("/route", json={"prompt": list(range(20001))})).json()
        assert long["prompt_blocks"] == 10000  # hashed off the event loop, same answer
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "chat_template": "T"}
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
        assert asked[-1] == {"model": "m", "messages": chat["messages"], "chat_template": "T"}
