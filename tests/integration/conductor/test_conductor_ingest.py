"""Real ZMQ publishers -> conductor -> HTTP and in-process queries."""

import pytest

from kvplane import kvevents
from kvplane.common.errors import NotFound
from kvplane.conductor.hashing import HashProfile
from kvplane.conductor.service import QueryRequest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]
BS = 16
P = HashProfile()
PROMPT = list(range(1000, 1000 + 5 * BS + 3))  # 5 complete blocks + a partial one


def hashes(tokens):
    return list(P.event_hashes(tokens, BS))


def register(http, pub, instance, **extra):
    body = {"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint, "modelname": "m",
            "instance_id": instance, "block_size": BS, **extra}
    r = http.post("/register", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "registered successfully"


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_connect_mode_store_query_remove(server, http, publishers, encoding, wait_seq):
    pub = publishers()
    register(http, pub, "e0")
    pub.wait_subscribed()
    hs = hashes(PROMPT)
    toks = PROMPT[: 5 * BS]
    pub.publish([kvevents.stored(hs[:3], toks[: 3 * BS], BS, encoding=encoding)])
    seq = pub.publish([kvevents.stored(hs[3:], toks[3 * BS:], BS, parent=hs[2], encoding=encoding)])
    wait_seq(server, "e0", seq)
    body = {"model": "m", "token_ids": PROMPT, "block_size": BS}
    assert http.post("/query", json=body).json() == {
        "default": {"e0": {"longest_matched": 80, "GPU": 80, "CPU": 80, "DISK": 80, "DP": {"0": 80}}}}
    by_hash = http.post("/query_by_hash", json={"model": "m", "seq_hashes": hs, "block_size": BS})
    assert by_hash.json() == http.post("/query", json=body).json()
    in_process = server.conductor.query(QueryRequest("m", token_ids=PROMPT, block_size=BS))
    assert in_process == by_hash.json()
    seq = pub.publish([kvevents.removed([hs[1]], encoding=encoding)])
    wait_seq(server, "e0", seq)
    assert http.post("/query", json=body).json()["default"]["e0"]["GPU"] == BS
    seq = pub.publish([kvevents.cleared(encoding)])
    wait_seq(server, "e0", seq)
    assert http.post("/query", json=body).json()["default"]["e0"]["longest_matched"] == 0
    assert server.ingestor.stats.malformed == 0 and server.ingestor.stats.gaps == 0


def test_bind_mode_routes_by_topic_and_dp_rank(server, http, publishers, wait_seq):
    (sub_ep,) = server.zmq_endpoints
    for inst in ("a", "b"):
        r = http.post("/register", json={"modelname": "m", "instance_id": inst, "block_size": BS,
                                         "topic": f"kv@{inst}", "dp_size": 2})
        assert r.status_code == 200
    pa0 = publishers(connect=sub_ep, topic="kv@a", dp_rank=0, replay=False)
    pa1 = publishers(connect=sub_ep, topic="kv@a", dp_rank=1, replay=False)
    pb = publishers(connect=sub_ep, topic="kv@b", dp_rank=0, replay=False)
    for p in (pa0, pa1, pb):
        p.wait_subscribed()
    hs = hashes(PROMPT)
    s0 = pa0.publish([kvevents.stored(hs[:1], PROMPT[:BS], BS)])
    s1 = pa1.publish([kvevents.stored(hs[:4], PROMPT[: 4 * BS], BS)])
    s2 = pb.publish([kvevents.stored(hs[:2], PROMPT[: 2 * BS], BS)])
    wait_seq(server, "a", s0, rank=0)
    wait_seq(server, "a", s1, rank=1)
    wait_seq(server, "b", s2, rank=0)
    r = http.post("/query", json={"model": "m", "token_ids": PROMPT}).json()["default"]
    assert r["a"]["DP"] == {"0": 16, "1": 64} and r["a"]["GPU"] == 64
    assert r["b"]["DP"] == {"0": 32, "1": 0} and r["b"]["longest_matched"] == 32


def test_many_instances_each_with_its_own_prefix(server, http, publishers, wait_seq):
    pubs = []
    for i in range(8):
        pub = publishers()
        register(http, pub, f"i{i}")
        pubs.append(pub)
    hs = hashes(PROMPT)
    for i, pub in enumerate(pubs):
        pub.wait_subscribed()
        seq = pub.publish([kvevents.stored(hs[: i % 6], PROMPT[: (i % 6) * BS], BS)])
        wait_seq(server, f"i{i}", seq)
    r = http.post("/query", json={"model": "m", "token_ids": PROMPT, "block_size": BS}).json()
    assert {k: v["longest_matched"] for k, v in r["default"].items()} == {
        f"i{i}": (i % 6) * BS for i in range(8)}
    one = http.post("/query", json={"model": "m", "token_ids": PROMPT, "instance_id": "i3"}).json()
    assert list(one["default"]) == ["i3"] and one["default"]["i3"]["GPU"] == 48


def test_unregister_stops_ingest_and_forgets(server, http, publishers, wait_seq):
    pub = publishers()
    register(http, pub, "e0")
    pub.wait_subscribed()
    seq = pub.publish([kvevents.stored(hashes(PROMPT), PROMPT[: 5 * BS], BS)])
    wait_seq(server, "e0", seq)
    r = http.post("/unregister", json={"instance_id": "e0", "modelname": "m", "block_size": BS})
    assert r.json() == {"status": "unregistered successfully", "removed_instances": ["e0|default|0"]}
    assert server.conductor.health()["blocks"] == 0
    assert http.post("/unregister", json={"instance_id": "e0"}).status_code == 404


def test_instances_health_metrics(server, http, publishers, wait_seq):
    pub = publishers()
    register(http, pub, "e0", hash_profile={"algorithm": "sha256", "python_hash_seed": "0"})
    pub.wait_subscribed()
    seq = pub.publish([kvevents.stored(hashes(PROMPT), PROMPT[: 5 * BS], BS)])
    wait_seq(server, "e0", seq)
    (row,) = http.get("/instances").json()
    assert row["instance_id"] == "e0" and row["blocks"]["GPU"] == 5 and row["hash_status"] == "ok"
    assert row["hash_profile"]["algorithm"] == "sha256" and row["last_seq"] == seq
    health = http.get("/health").json()
    assert health["status"] == "ok" and health["blocks"] == 5
    text = http.get("/metrics").text
    assert 'kvplane_conductor_index_size{what="blocks"} 5.0' in text
    assert "kvplane_conductor_block_events_total" in text
    assert http.get("/openapi.json").json()["paths"].keys() >= {"/register", "/query", "/query_by_hash"}


def test_mismatched_profile_reported_over_http(server, http, publishers, wait_seq):
    pub = publishers()
    register(http, pub, "e0", hash_profile={"algorithm": "sha256_cbor", "python_hash_seed": "0"})
    pub.wait_subscribed()
    seq = pub.publish([kvevents.stored(hashes(PROMPT), PROMPT[: 5 * BS], BS)])  # engine used sha256
    wait_seq(server, "e0", seq)
    assert http.get("/health").json()["status"] == "degraded"
    assert http.get("/instances").json()[0]["hash_status"] == "mismatch"
    other = {"modelname": "m", "instance_id": "e1", "block_size": BS,
             "hash_profile": {"algorithm": "sha256"}}
    r = http.post("/register", json=other)
    assert r.status_code == 409 and "hash profile mismatch" in r.json()["detail"]


def test_shared_token(make_server):
    import httpx
    srv = make_server(token="s3cret")
    with httpx.Client(base_url=srv.url, timeout=10) as h:
        body = {"modelname": "m", "instance_id": "x", "block_size": BS}
        assert h.post("/register", json=body).status_code == 401
        assert h.post("/register", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert h.post("/register", json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert h.get("/instances", headers={"X-KVPlane-Token": "s3cret"}).status_code == 200
        assert h.get("/metrics").status_code == 401
        assert h.get("/health").status_code == 200
        query = {"model": "m", "token_ids": list(range(BS)), "block_size": BS}
        for path, q in (("/query", query), ("/query_by_hash", {"model": "m", "seq_hashes": [1]})):
            r = h.post(path, json=q)  # the token gate stands in front of the query fast path too
            assert r.status_code == 401 and "missing or wrong token" in r.json()["detail"]
            assert h.post(path, json=q, headers={"Authorization": "Bearer nope"}).status_code == 401
            ok = h.post(path, json=q, headers={"X-KVPlane-Token": "s3cret"})
            assert ok.status_code == 200 and ok.headers["content-type"] == "application/json"
            assert ok.json() == {"default": {"x": {"longest_matched": 0, "GPU": 0, "CPU": 0,
                                                   "DISK": 0, "DP": {"0": 0}}}}
        r = h.post("/query", json={**query, "instance_id": "nobody"}, headers={"X-KVPlane-Token": "s3cret"})
        assert r.status_code == 404 and r.json()["code"] == NotFound.code


def test_query_bodies_json_msgpack_and_422(server, http, publishers, wait_seq):
    import msgspec
    pub = publishers()
    register(http, pub, "e0")
    pub.wait_subscribed()
    hs = hashes(PROMPT)
    wait_seq(server, "e0", pub.publish([kvevents.stored(hs[:2], PROMPT[: 2 * BS], BS)]))
    body = {"model": "m", "token_ids": PROMPT, "block_size": BS}
    packed = http.post("/query", content=msgspec.msgpack.encode(body),
                       headers={"content-type": "application/msgpack"})
    assert packed.status_code == 200 and packed.json() == http.post("/query", json=body).json()
    assert packed.json()["default"]["e0"]["GPU"] == 32
    assert http.post("/query", json={"model": "m", "seq_hashes": hs}).status_code == 422
    assert http.post("/query_by_hash", json={"model": "m", "seq_hashes": [2**64]}).status_code == 422
    assert http.post("/query_by_hash", json={"model": "m", "seq_hashes": [-1]}).status_code == 422
    assert http.post("/query", json={"model": "m", "token_ids": [2**32]}).status_code == 422
    assert http.post("/query", json={"model": "m", "token_ids": [1], "block_size": 0}).status_code == 422
    by_alias = http.post("/query_by_hash", json={"model": "m", "block_hash": hs})
    assert by_alias.json()["default"]["e0"]["longest_matched"] == 32
