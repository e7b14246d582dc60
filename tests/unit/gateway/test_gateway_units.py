"""Pure parts of `kvplane router`: backend specs, config rules, vLLM metrics parsing, SSE framing,
racing a read against ejection, and the policy a router builds."""

from __future__ import annotations

import asyncio
import math

import pytest

from kvplane.common.errors import InvalidArgument
from kvplane.conductor.gateway.config import BackendSpec, GatewayConfig, PoolSpec
from kvplane.conductor.gateway.pool import Backend, parse_vllm_metrics
from kvplane.conductor.gateway.relay import BackendGone, error_event, is_data, race, sse_events, stop_tasks
from kvplane.conductor.gateway.server import sim_config

pytestmark = pytest.mark.timeout(10)
B = BackendSpec("http://127.0.0.1:8001")


def test_backend_spec_parse_and_defaults():
    s = BackendSpec.parse("http://h:1/,id=e0,events=tcp://h:5557,replay=tcp://h:5558")
    assert (s.url, s.id, s.events, s.replay, s.topic, s.role) == (
        "http://h:1", "e0", "tcp://h:5557", "tcp://h:5558", "kv@e0", "both")
    assert BackendSpec.parse("http://h:2", "decode").id == "h:2"
    for bad in ("h:1", "http://h:1,color=red", "http://h:1,events=udp://x"):
        with pytest.raises(InvalidArgument):
            BackendSpec.parse(bad)
    assert BackendSpec.from_dict({"url": "http://h:3", "role": "prefill"}).role == "prefill"
    with pytest.raises(InvalidArgument):
        BackendSpec.from_dict({"role": "prefill"})


def test_pool_spec_parse_and_rules():
    p = PoolSpec.parse("tcp://h:5600,replay=tcp://h:5601,token=s3cret,id=l3")
    assert (p.events, p.replay, p.token, p.id, p.type) == (
        "tcp://h:5600", "tcp://h:5601", "s3cret", "l3", "kvplane")
    assert "s3cret" not in repr(p)  # the token is never listed
    assert PoolSpec.parse("ipc:///tmp/ev,type=mooncake").type == "mooncake"
    for bad in ("h:5600", "tcp://h:1,colour=red", "tcp://h:1,type=redis", "tcp://h:1,id=",
                "tcp://h:1,replay=udp://x"):
        with pytest.raises(InvalidArgument):
            PoolSpec.parse(bad)
    with pytest.raises(InvalidArgument, match="distinct"):
        GatewayConfig(backends=(B,), pools=(PoolSpec("tcp://h:1", id=B.id),))
    with pytest.raises(InvalidArgument, match="distinct"):
        GatewayConfig(backends=(B,), pools=(PoolSpec("tcp://h:1"), PoolSpec("tcp://h:2")))


def test_config_rules():
    with pytest.raises(InvalidArgument, match="at least one backend"):
        GatewayConfig()
    with pytest.raises(InvalidArgument, match="colocated"):
        GatewayConfig(backends=(BackendSpec("http://h:1", "prefill"),))
    with pytest.raises(InvalidArgument, match="PD mode"):
        GatewayConfig(mode="pd", backends=(BackendSpec("http://h:1", "prefill"),))
    with pytest.raises(InvalidArgument, match="unique"):
        GatewayConfig(backends=(B, B))
    with pytest.raises(InvalidArgument):
        GatewayConfig(backends=(B,), read_timeout_s=0)
    cfg = GatewayConfig(backends=(B,))
    assert not cfg.pd and cfg.ejection_bound_s <= 2.0  # the ejection bound by default
    assert GatewayConfig(discover="memory://x", mode="pd").pd


def test_router_policy_never_rejects_or_pulls_unless_asked():
    name, cfg = sim_config(GatewayConfig(backends=(B,), block_size=32))
    assert name == "mooncake" and cfg.policy.rejection == "none"
    assert math.isinf(cfg.policy.balancing_threshold) and cfg.cluster.block_tokens == 32
    _, on = sim_config(GatewayConfig(backends=(B,), reject=True, pull_hints=True,
                                     policy="mooncake@balancing_threshold=2",
                                     settings=(("model.prefill_fit", "0.01,1e-4,1e-8"),)))
    assert on.policy.rejection == "predictive" and on.policy.balancing_threshold == 2.0
    assert on.model.prefill_fit == (0.01, 1e-4, 1e-8)
    with pytest.raises(InvalidArgument):
        sim_config(GatewayConfig(backends=(B,), policy="nope"))


VLLM_METRICS = """# HELP vllm:num_requests_running x
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 640.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 320.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",kv_cache_size_tokens="524288",prefix_caching_hash_algo="sha256"} 1.0
"""


def test_parse_vllm_metrics_reads_load_cache_and_config():
    b = Backend(B)
    parse_vllm_metrics(VLLM_METRICS, b)
    assert (b.running, b.waiting, b.prefix_queries, b.prefix_hits) == (4, 2, 640.0, 320.0)
    assert (b.block_size, b.kv_capacity, b.hash_algo) == (32, 524288, "sha256")


async def _chunks(*parts: bytes):
    for p in parts:
        yield p


async def test_sse_events_reframes_split_and_joined_chunks():
    got = [e async for e in sse_events(_chunks(b"data: 1\n", b"\ndata: 2\n\nda", b"ta: [DONE]\r\n\r\n",
                                                b"data: partial"))]
    assert got == [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]
    assert is_data(got[0]) and not is_data(b": keepalive\n\n")
    err = error_event("boom")
    assert err.startswith(b"data: {\"error\"") and err.endswith(b"data: [DONE]\n\n")
    with pytest.raises(ValueError):
        [e async for e in sse_events(_chunks(b"x" * (9 << 20)))]


async def test_race_returns_the_result_or_raises_when_the_backend_goes():
    gone = asyncio.Event()
    assert await race(asyncio.sleep(0, result=7), gone) == 7
    slow = asyncio.ensure_future(asyncio.sleep(30))

    async def fire():
        gone.set()

    asyncio.get_running_loop().call_later(0.01, lambda: asyncio.ensure_future(fire()))
    with pytest.raises(BackendGone):
        await race(slow, gone)
    await asyncio.sleep(0)
    assert slow.cancelled()
    with pytest.raises(BackendGone):  # already gone: never waits
        await race(asyncio.sleep(30), gone)


async def test_race_grace_lets_a_live_read_finish_after_the_backend_is_gone():
    gone = asyncio.Event()
    gone.set()
    assert await race(asyncio.sleep(0.01, result="token"), gone, grace=2.0) == "token"
    with pytest.raises(BackendGone):
        await race(asyncio.sleep(30), gone, grace=0.05)


async def test_stop_tasks_stops_a_loop_that_lost_a_cancellation():
    # a loop that swallows the first CancelledError (as Python 3.11's wait_for can) must still
    # stop; one that never stops is handed back after the timeout instead of hanging shutdown
    swallowed = []

    async def lossy() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(1)

    release = []

    async def stubborn() -> None:
        while not release:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass

    a = asyncio.ensure_future(lossy())
    await asyncio.sleep(0)
    assert await stop_tasks([a], timeout=2) == [] and a.cancelled() and swallowed == [1]
    b = asyncio.ensure_future(stubborn())
    await asyncio.sleep(0)
    assert await stop_tasks([b], timeout=0.3) == [b] and not b.done()
    release.append(1)  # leave nothing behind
    b.cancel()
    await asyncio.wait({b}, timeout=2)
    assert b.done()
