"""Routing through `kvplane router` with the shared policies, over fake vLLM servers' KV events."""

from __future__ import annotations

import json

import pytest

from kvplane.conductor.gateway import instruments
from tests.support.fake_vllm import FakeVLLM, words
from tests.support.fake_vllm import router_over_fakes as cluster

BS = 4  # the fakes' block size: 4n words are n blocks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
PREFIX = list(range(20, 52))  # 8 blocks of 4


def complete(http, url: str, prompt: str, **extra) -> tuple[str, dict]:
    r = http.post(url + "/v1/completions", json={"model": "fake", "prompt": prompt,
                                                 "max_tokens": 4, **extra})
    assert r.status_code == 200, r.text
    return r.headers["x-kvplane-backend"], r.json()


def indexed(server, fake: FakeVLLM, blocks: int) -> bool:
    """Wait until the router's index holds ``blocks`` blocks of ``fake`` (from its KV events)."""
    c = server.conductor
    return c.wait_until(lambda: sum(r["blocks"]["GPU"] for r in c.instances()
                                    if r["instance_id"] == fake.id) >= blocks, 10)


def test_prefix_sharing_requests_go_to_the_holder(http):
    with cluster(3, policy="mooncake") as (server, fakes):
        first, _ = complete(http, server.url, words(*PREFIX, 900))
        holder = next(f for f in fakes if f.id == first)
        assert indexed(server, holder, len(PREFIX) // BS)
        hits_before = instruments.HIT_BLOCKS._value.get()
        for suffix in range(5):
            got, _ = complete(http, server.url, words(*PREFIX, 901 + suffix, 902, 903, 904))
            assert got == holder.id
        assert instruments.HIT_BLOCKS._value.get() - hits_before == 5 * len(PREFIX) // BS
        # the fake's own prefix-cache counters agree: every follow-up hit the 8 shared blocks
        assert holder.hits == 5 * len(PREFIX)
        route = http.post(server.url + "/route", json={"prompt": words(*PREFIX, 7)}).json()
        assert route["backend"] == holder.url and route["prefix_blocks"] == len(PREFIX) // BS
        # an unrelated prompt is not pulled to the holder by the shared-nothing index
        other = http.post(server.url + "/route", json={"prompt": words(*range(300, 332))}).json()
        assert other["prefix_blocks"] == 0


def test_round_robin_spreads_prefix_sharing_requests(http):
    with cluster(3, policy="round-robin") as (server, fakes):
        seen = [complete(http, server.url, words(*PREFIX, 900 + i))[0] for i in range(6)]
        assert sorted(seen) == sorted([f.id for f in fakes] * 2)


def test_least_loaded_avoids_the_busy_backend(http):
    import threading

    with cluster(2, policy="least-loaded") as (server, fakes):
        busy, idle = fakes
        busy.stall = True
        server.router.set_available(idle.id, False)  # force the first request onto `busy`
        t = threading.Thread(target=complete, args=(http, server.url, words(1, 2, 3)))
        t.start()
        assert server.router.in_flight() == 1 or _wait(lambda: server.router.in_flight() == 1)
        server.router.set_available(idle.id, True)
        for i in range(3):
            assert complete(http, server.url, words(5, 6, 7, i))[0] == idle.id
        busy.release.set()
        t.join(10)


def _wait(cond, timeout: float = 5.0) -> bool:
    from tests.support.services import wait_until

    wait_until(cond, timeout, "condition")
    return True


def test_streaming_through_the_router_equals_direct_output(http):
    with cluster(2, policy="mooncake") as (server, fakes):
        body = {"model": "fake", "prompt": words(*PREFIX), "max_tokens": 6, "stream": True}
        via = http.post(server.url + "/v1/completions", json=body)
        direct = http.post(fakes[0].url + "/v1/completions", json=body)
        assert via.status_code == 200 and via.headers["content-type"].startswith("text/event-stream")
        assert via.text == direct.text and via.text.endswith("data: [DONE]\n\n")
        chat = {"model": "fake", "messages": [{"role": "user", "content": words(3, 4)}],
                "stream": True, "max_tokens": 3}
        assert http.post(server.url + "/v1/chat/completions", json=chat).text == \
            http.post(fakes[1].url + "/v1/chat/completions", json=chat).text


def test_early_rejection_is_off_by_default_and_429_with_retry_after_when_on(http):
    tiny = (("policy.ttft_slo_s", "0.000001"),)
    with cluster(2, policy="mooncake", settings=tiny) as (server, _):
        assert complete(http, server.url, words(1, 2, 3, 4))[0]
    with cluster(2, policy="mooncake", settings=tiny, reject=True, retry_after_s=3) as (server, fakes):
        r = http.post(server.url + "/v1/completions", json={"prompt": words(1, 2, 3, 4)})
        assert r.status_code == 429 and r.headers["retry-after"] == "3"
        assert r.json()["error"]["type"] == "rejected" and not any(f.requests for f in fakes)
        route = http.post(server.url + "/route", json={"prompt": words(1, 2)})
        assert route.status_code == 429
        assert 'kvplane_router_rejected_total{reason="ttft"}' in http.get(server.url + "/metrics").text


def test_models_health_metrics_and_backends(http):
    with cluster(2) as (server, fakes):
        assert http.get(server.url + "/v1/models").json()["data"][0]["id"] == "fake"
        h = http.get(server.url + "/health").json()
        assert h["status"] == "ok" and h["backends_up"] == 2 and h["block_size"] == BS
        complete(http, server.url, words(*PREFIX))
        text = http.get(server.url + "/metrics").text
        for name in ("kvplane_router_routed_total", "kvplane_router_hit_blocks_total",
                     "kvplane_router_prompt_blocks_total", "kvplane_router_backend_queue",
                     "kvplane_router_backend_up", "kvplane_router_prefill_slowdown"):
            assert name in text
        # a streamed answer's first token is a measurement: the fakes answer far faster than the
        # router's default model (a 70B model on H100s) predicts
        r = http.post(server.url + "/v1/completions", json={"model": "fake", "stream": True,
                                                             "prompt": words(*PREFIX, 7)})
        assert r.status_code == 200 and server.router.slowdown < 1.0
        rows = http.get(server.url + "/backends").json()
        assert {r["id"] for r in rows} == {f.id for f in fakes}
        assert all(r["up"] and r["events_indexed"] and r["block_size"] == BS for r in rows)


def test_token_guards_every_endpoint_but_health_and_goes_upstream(http):
    with cluster(1, token="s3cret") as (server, (fake,)):
        assert http.get(server.url + "/health").status_code == 200
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/backends"),
                             ("POST", "/v1/completions"), ("POST", "/route")):
            assert http.request(method, server.url + path, json={}).status_code == 401, path
        r = http.post(server.url + "/v1/completions", json={"prompt": words(1, 2)},
                      headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200
        assert fake.headers[-1]["authorization"] == "Bearer s3cret"


def test_bad_bodies_are_client_errors(http):
    with cluster(1, max_request_bytes=1000) as (server, _):
        assert http.post(server.url + "/v1/completions", content=b"[1, 2]").status_code == 400
        assert http.post(server.url + "/v1/completions", content=b"{nope").status_code == 400
        big = json.dumps({"prompt": "t1 " * 1000})
        assert http.post(server.url + "/v1/completions", content=big).status_code == 413


def test_pd_prefills_then_decodes_with_the_returned_params(http):
    with cluster(4, roles=("prefill", "prefill", "decode", "decode"), policy="mooncake") as (server, fakes):
        p1, p2, d1, d2 = fakes
        for i in range(4):
            body = {"model": "fake", "prompt": words(*PREFIX, i), "max_tokens": 5}
            r = http.post(server.url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
        prefills = p1.requests + p2.requests
        decodes = d1.requests + d2.requests
        assert len(prefills) == 4 and len(decodes) == 4
        assert all(b["max_tokens"] == 1 and b["kv_transfer_params"]["do_remote_decode"] for b in prefills)
        assert all(b["max_tokens"] == 5 and b["kv_transfer_params"]["do_remote_decode"] for b in decodes)
        # Algorithm 1 keeps the shared prefix on one prefill instance
        assert sorted([len(p1.requests), len(p2.requests)]) == [0, 4]
        stream = http.post(server.url + "/v1/completions", json={"prompt": words(1, 2), "stream": True})
        assert stream.text.endswith("data: [DONE]\n\n")


def test_pd_decode_instance_is_chosen_by_predicted_load(http):
    import threading

    with cluster(3, roles=("prefill", "decode", "decode"), policy="mooncake") as (server, fakes):
        _, busy, idle = fakes
        busy.stall = True
        server.router.set_available(idle.id, False)  # force the first decode onto `busy`
        t = threading.Thread(target=complete, args=(http, server.url, words(1, 2, 3)))
        t.start()
        try:
            assert _wait(lambda: len(busy.requests) == 1)  # prefilled, now decoding (stalled) there
            server.router.set_available(idle.id, True)
            for i in range(3):
                assert complete(http, server.url, words(5, 6, 7, i))[0] == idle.id
            assert len(busy.requests) == 1 and len(idle.requests) == 3
        finally:
            busy.release.set()
            t.join(10)
        assert not t.is_alive()


def test_backends_discovered_through_the_metadata_service(http):
    from kvplane.conductor.gateway.config import GatewayConfig
    from kvplane.conductor.gateway.server import GatewayServer
    from kvplane.transfer.metadata import MemoryMetadata
    from tests.support.services import wait_until

    meta = MemoryMetadata("router-discovery-test")
    with FakeVLLM() as a, FakeVLLM() as b:
        meta.put("kvplane/router/backends", json.dumps([{"url": a.url}]).encode())
        cfg = GatewayConfig(port=0, discover="memory://router-discovery-test",
                            discover_interval_s=0.1, policy="round-robin")
        with GatewayServer(cfg) as server:
            assert [x.id for x in server.pool.healthy()] == [a.id]  # read before it served
            meta.put("kvplane/router/backends", json.dumps([{"url": a.url}, {"url": b.url}]).encode())
            wait_until(lambda: len(server.pool.healthy()) == 2, 5, "second backend")
            assert {complete(http, server.url, words(i))[0] for i in range(4)} == {a.id, b.id}
            meta.put("kvplane/router/backends", json.dumps([{"url": b.url}]).encode())
            wait_until(lambda: not server.pool.get(a.id).up, 5, "unlisted backend ejected")
            assert {complete(http, server.url, words(i))[0] for i in range(3)} == {b.id}
            meta.put("kvplane/router/backends", b"not json")
            wait_until(lambda: server.pool.discovery_errors > 0, 5, "bad list counted")
            assert server.pool.get(b.id).up  # a bad list changes nothing


def test_a_prefix_in_a_shared_pool_is_reusable_on_every_instance(http):
    """``--pool``: the router indexes a kvplane master's KV events; blocks a vLLM connector
    stored there (one object per layer, keys named by the vLLM block hash) are a prefix hit
    for every instance, though no instance holds them."""
    from kvplane.conductor.gateway.config import PoolSpec
    from kvplane.integrations.vllm.plan import KeySpace
    from kvplane.store import MasterServer, StoreClient
    from tests.support.services import wait_until

    token = "pool-service-token"  # an authenticated stream (ZMQ PLAIN), as masters run
    with MasterServer(admin_port=None, kv_events_port=0, token=token) as m:
        pool = PoolSpec(m.events.endpoint, m.events.replay_endpoint, token)
        with cluster(2, policy="mooncake", pools=(pool,)) as (server, fakes):
            route = {"prompt": words(*PREFIX, 7)}
            assert http.post(server.url + "/route", json=route).json()["prefix_blocks"] == 0
            wait_until(lambda: "pool" in server.pool.pools_registered, 10, "pool indexed")
            m.events.pub.wait_subscribed()
            digests = list(server.config.hash_profile.digests(PREFIX, BS))
            space = KeySpace("m", "float32", BS, 2)
            keys = [k for d in digests for k in space.block_keys(d)]
            with StoreClient(master=f"127.0.0.1:{m.port}", token=token,
                             global_segment_size=1 << 20) as c:
                assert c.put_batch(keys, [b"kv"] * len(keys)) == [None] * len(keys)
                wait_until(lambda: http.post(server.url + "/route", json=route).json()
                           ["prefix_blocks"] == len(PREFIX) // BS, 10, "pool blocks indexed")
            assert all(f.hits == 0 for f in fakes)  # no instance held them
