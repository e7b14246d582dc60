"""PD pure parts (pull planning) and the pd-proxy choreography against mocked instances."""

from __future__ import annotations

import json

import httpx
import pytest

from kvplane.cli import pd_proxy
from kvplane.integrations.vllm.layout import KVLayout, LayerSpan
from kvplane.integrations.vllm.pd_plan import params_ok, pull_job, read_requests
from kvplane.transfer import OpCode

pytestmark = pytest.mark.timeout(20)
LAYERS = [[1 << 20, 4096, 64], [2 << 20, 4096, 64]]
PARAMS = {"remote_segment": "127.0.0.1:9", "remote_notify": "tcp://127.0.0.1:8",
          "remote_layers": LAYERS, "remote_block_ids": [40, 41, 42, 43], "remote_request_id": "p1"}


def test_pull_job_maps_prompt_blocks_past_the_local_hit():
    job = pull_job("d1", PARAMS, [7, 8, 9, 10, 11], 32, 65, 32)  # 97-token prompt, 1 block local
    assert job.local_blocks == [8, 9, 10] and job.remote_blocks == [41, 42, 43]
    assert job.remote_req_id == "p1" and job.segment == "127.0.0.1:9"
    full = pull_job("d1", PARAMS, [7, 8, 9, 10], 0, 97, 32)
    assert full.local_blocks == [7, 8, 9, 10] and full.remote_blocks == [40, 41, 42, 43]


def test_pull_job_without_a_source_leaves_blocks_for_recompute():
    release = pull_job("d1", PARAMS, [7, 8], 64, 0, 32)  # local hit: nothing to read
    assert release.local_blocks == [] and release.remote_blocks == []
    short = pull_job("d1", {**PARAMS, "remote_block_ids": [40]}, [7, 8, 9], 0, 90, 32)
    assert short.local_blocks == [7, 8, 9] and short.remote_blocks == []  # -> reported failed
    bad = pull_job("d1", {**PARAMS, "remote_layers": [["x"]]}, [7, 8, 9], 0, 90, 32)
    assert bad.remote_blocks == []
    assert not params_ok({"remote_segment": "a"}) and params_ok(PARAMS)


def test_read_requests_pair_remote_and_local_addresses_per_layer():
    job = pull_job("d1", PARAMS, [0, 1, 2, 3], 0, 40, 32)
    local = KVLayout.from_spans([LayerSpan(8 << 20, 4096, 16), LayerSpan(9 << 20, 4096, 16)])
    reqs = read_requests(job, local, handle=5)
    assert [(r.source, r.target_offset) for r in reqs] == [
        ((8 << 20), (1 << 20) + 40 * 4096), ((9 << 20), (2 << 20) + 40 * 4096),
        ((8 << 20) + 4096, (1 << 20) + 41 * 4096), ((9 << 20) + 4096, (2 << 20) + 41 * 4096)]
    assert all(r.op == OpCode.READ and r.target == 5 and r.length == 4096 for r in reqs)
    other = KVLayout.from_spans([LayerSpan(8 << 20, 2048, 16), LayerSpan(9 << 20, 2048, 16)])
    with pytest.raises(Exception, match="layouts differ"):
        read_requests(job, other, handle=5)


def proxy_with(upstream) -> httpx.AsyncClient:
    """The proxy app in process (ASGI), its upstream instances mocked."""
    app = pd_proxy.build_app(["http://p1", "http://p2"], ["http://d1"], 10,
                             transport=httpx.MockTransport(upstream))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy")


async def test_proxy_prefills_then_decodes_with_the_returned_params_round_robin():
    seen = []

    def upstream(req: httpx.Request) -> httpx.Response:
        body = json.loads(req.content)
        seen.append((req.url.host, body))
        if req.url.host.startswith("p"):
            return httpx.Response(200, json={"choices": [{"text": "x"}],
                                             "kv_transfer_params": {"remote_block_ids": [1]}})
        return httpx.Response(200, json={"choices": [{"token_ids": [4, 5]}]})

    async with proxy_with(upstream) as client:
        for _ in range(2):
            r = await client.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 5})
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [4, 5]
    hosts = [h for h, _ in seen]
    assert hosts == ["p1", "d1", "p2", "d1"]
    p_body, d_body = seen[0][1], seen[1][1]
    assert p_body["max_tokens"] == 1 and p_body["kv_transfer_params"]["do_remote_decode"] is True
    assert d_body["max_tokens"] == 5 and d_body["kv_transfer_params"] == {"remote_block_ids": [1]}


async def test_proxy_streams_the_decode_answer_and_reports_a_prefill_without_params():
    def upstream(req: httpx.Request) -> httpx.Response:
        if req.url.host.startswith("p"):
            return httpx.Response(200, json={"kv_transfer_params": {"a": 1}})
        return httpx.Response(200, content=b"data: 1\n\ndata: [DONE]\n\n")

    async with proxy_with(upstream) as client:
        r = await client.post("/v1/completions", json={"prompt": [1], "stream": True})
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")

    async with proxy_with(lambda req: httpx.Response(200, json={"choices": []})) as client:
        r = await client.post("/v1/chat/completions", json={"messages": []})
        assert r.status_code == 502 and "no kv_transfer_params" in r.json()["error"]
