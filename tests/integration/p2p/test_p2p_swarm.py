"""P2P store with real node processes on 127.0.0.1: intact bytes, a growing swarm, corrupt holders,
version isolation and collection of old versions."""


import pytest

from kvplane.common.procs import wait_until
from tests.support.p2p_nodes import ask_all, recv, send

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
MIB = 1 << 20


def test_six_receivers_get_intact_bytes_and_serve_each_other_while_fetching(tracker, nodes):
    pub, *rx = nodes(7)
    want = pub.ask('{"op": "publish", "name": "weights", "size": %d, "seed": 1}' % (48 * MIB))
    outs = ask_all(rx, op="get", name="weights")
    for out in outs:
        assert "error" not in out, out
        assert out["sha"] == want["sha"] and out["version"] == 1
    st = tracker.status("weights")
    gold = st["gold"]
    assert st["holders_per_chunk"] == [7] * 48  # every receiver became a holder of every chunk
    served_by_peers = {h: n for h, n in st["served"].items() if h != gold}
    assert sum(served_by_peers.values()) > 0, st["served"]
    # the swarm grew during the transfer: a receiver served chunks before it had them all
    early = [h for h, t in st["first_served"].items() if h != gold and t < st["completed"][h]]
    assert early, (st["first_served"], st["completed"])
    # the publisher sent less than every receiver fetching from it alone would have needed
    assert st["served"][gold] < 6 * 48


def test_one_corrupt_chunk_is_rejected_and_fetched_elsewhere(tracker, nodes):
    pub, bad, reader = nodes(3)
    want = pub.ask('{"op": "publish", "name": "two", "size": %d, "seed": 2}' % MIB)  # 2 chunks
    assert bad.ask('{"op": "get", "name": "two"}')["sha"] == want["sha"]
    bad.ask('{"op": "corrupt", "chunks": [0, 1]}')
    out = reader.ask('{"op": "get", "name": "two"}', timeout=60)
    # At equal load a replica goes before the publisher: the first chunk assigned comes from
    # the corrupt holder, the second (it is then busier) from the publisher.
    assert out["failures"] == {"corrupt": 1}, out
    assert out["sha"] == want["sha"]
    st = tracker.status("two")
    assert out["sources"] == {st["gold"]: 2}  # the rejected chunk was refetched from the publisher
    assert st["failures"] == {"corrupt": 1}
    # the bad copy is no longer offered for the chunk that failed; the other one was never used
    assert sorted(st["holders_per_chunk"]) == [2, 3]


def test_corrupt_holder_never_poisons_four_receivers(tracker, nodes):
    pub, bad, *rx = nodes(6)
    want = pub.ask('{"op": "publish", "name": "many", "size": %d, "seed": 3}' % (8 * MIB))
    bad.ask('{"op": "get", "name": "many"}')
    bad.ask('{"op": "corrupt", "chunks": [0, 1, 2, 3, 4, 5, 6, 7]}')
    outs = ask_all(rx, op="get", name="many")
    assert all(o["sha"] == want["sha"] for o in outs), outs
    corrupt = sum(o["failures"].get("corrupt", 0) for o in outs)
    assert corrupt >= 1
    assert tracker.status("many")["failures"]["corrupt"] == corrupt


def test_readers_of_a_version_never_get_the_next_ones_bytes(tracker, nodes):
    pub, r1, r2, r3, r4 = nodes(5)
    v1 = pub.ask('{"op": "publish", "name": "policy", "size": %d, "seed": 10}' % (8 * MIB))
    assert r1.ask('{"op": "get", "name": "policy"}')["sha"] == v1["sha"]  # r1 holds v1
    # the trainer updates its weights in place (v2 bytes) before telling anyone
    v2_sha = pub.ask('{"op": "mutate", "seed": 11}')["sha"]
    outs = ask_all([r2, r4], op="get", name="policy", version=1)
    for out in outs:
        assert out["version"] == 1 and out["sha"] == v1["sha"], out  # no byte of v2 got in
    # the publisher's changed chunks were offered and refused
    assert sum(o["failures"].get("corrupt", 0) for o in outs) >= 1, outs
    # now it publishes v2 from the same memory: its v1 copy is withdrawn
    v2 = pub.ask('{"op": "publish", "name": "policy", "size": %d, "seed": 11, "version": 2}' % (8 * MIB))
    assert v2["sha"] == v2_sha and v2["version"] == 2
    out3 = r3.ask('{"op": "get", "name": "policy"}')
    assert out3["version"] == 2 and out3["sha"] == v2["sha"]


def test_old_version_is_kept_while_read_then_collected(tracker, nodes):
    pub, r1 = nodes(2)
    pub.ask('{"op": "publish", "name": "ckpt", "size": %d, "seed": 20}' % (2 * MIB))
    r1.ask('{"op": "get", "name": "ckpt"}')
    regions_v1 = r1.ask('{"op": "regions"}')["regions"]
    tracker.open("ckpt", "reader-holding-v1", 1)  # a reader still holds v1
    pub.ask('{"op": "publish", "name": "ckpt", "size": %d, "seed": 21}' % (2 * MIB))
    listed = {v["version"]: v for v in tracker.ls("ckpt")[0]["versions"]}
    assert listed[1]["retired"] and listed[1]["readers"] == 1 and 2 in listed
    assert ["ckpt", 1] in r1.ask('{"op": "holdings"}')["holdings"]
    tracker.release("ckpt", 1, "reader-holding-v1")
    wait_until(lambda: [v["version"] for v in tracker.ls("ckpt")[0]["versions"]] == [2],
               20.0, "v1 collected")
    # the holder learns it at its next heartbeat and unregisters the memory
    wait_until(lambda: r1.ask('{"op": "holdings"}')["holdings"] == [], 20.0, "r1 dropped v1")
    assert r1.ask('{"op": "regions"}')["regions"] == regions_v1 - 1
    out = r1.ask('{"op": "get", "name": "ckpt", "version": 1}')
    assert "NotFound" in out["error"]


def test_unknown_name_and_bad_token_fail_cleanly(tracker, nodes):
    from kvplane.common.errors import NotFound, Unauthorized
    from kvplane.p2p import TrackerClient

    (r,) = nodes(1)
    assert "NotFound" in r.ask('{"op": "get", "name": "nope"}')["error"]
    with pytest.raises(NotFound):
        tracker.open("nope", "x")
    bad = TrackerClient(tracker.url, "wrong")
    try:
        with pytest.raises(Unauthorized):
            bad.ls()
    finally:
        bad.close()
    import httpx

    assert httpx.get(tracker.url + "/health").status_code == 200  # /health needs no token


def test_send_recv_helpers_keep_order(nodes):
    (r,) = nodes(1)
    send(r, op="holdings")
    assert recv(r) == {"holdings": []}
