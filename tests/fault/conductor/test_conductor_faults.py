"""Ingest faults: dropped sequence ranges, publisher restarts, malformed and oversized input."""

import msgspec
import pytest

from kvplane import kvevents
from kvplane.conductor.hashing import HashProfile

pytestmark = [pytest.mark.fault, pytest.mark.timeout(30)]
BS = 16
P = HashProfile()
PROMPT = list(range(1, 1 + 8 * BS))
HS = list(P.event_hashes(PROMPT, BS))


def block(i, **kw):
    return kvevents.stored([HS[i]], PROMPT[i * BS:(i + 1) * BS], BS,
                        parent=HS[i - 1] if i else None, **kw)


def gpu_tokens(http, inst="e0"):
    r = http.post("/query", json={"model": "m", "token_ids": PROMPT, "block_size": BS})
    assert r.status_code == 200, r.text
    return r.json()["default"][inst]["GPU"]


def register(http, pub, inst="e0", replay=True):
    body = {"endpoint": pub.endpoint, "modelname": "m", "instance_id": inst, "block_size": BS}
    if replay:
        body["replay_endpoint"] = pub.replay_endpoint
    assert http.post("/register", json=body).status_code == 200
    pub.wait_subscribed()


@pytest.mark.parametrize("replay_topic", [False, True])
def test_dropped_sequence_range_is_replayed(server, http, publishers, wait_seq, replay_topic):
    pub = publishers(replay_topic=replay_topic)
    register(http, pub)
    wait_seq(server, "e0", pub.publish([block(0)]))
    for i in (1, 2, 3):  # seqs 1..3 never reach the subscriber
        pub.publish([block(i)], drop=True)
    seq = pub.publish([block(4)])
    wait_seq(server, "e0", seq)
    st = server.ingestor.stats
    assert (st.gaps, st.replayed, st.replay_failures, st.resets) == (1, 3, 0, 0)
    assert pub.replay_requests == 1
    assert gpu_tokens(http) == 5 * BS  # blocks 1..3 came from the replay, in order


def test_replayed_remove_is_applied_before_later_events(server, http, publishers, wait_seq):
    pub = publishers()
    register(http, pub)
    pub.publish([block(0), block(1)])
    pub.publish([kvevents.removed([HS[1]])], drop=True)
    wait_seq(server, "e0", pub.publish([block(2)]))
    assert gpu_tokens(http) == BS  # block 1 evicted: the chain stops after block 0


def test_gap_without_replay_endpoint_drops_stream_then_rebuilds(server, http, publishers, wait_seq):
    pub = publishers()
    register(http, pub, replay=False)
    wait_seq(server, "e0", pub.publish([block(0), block(1)]))
    pub.publish([kvevents.removed([HS[1]])], drop=True)  # unknown loss: stale state must go
    wait_seq(server, "e0", pub.publish([block(5)]))
    st = server.ingestor.stats
    assert st.gaps == 1 and st.replay_failures == 1 and st.resets == 1
    assert gpu_tokens(http) == 0
    wait_seq(server, "e0", pub.publish([block(0)]))  # live events rebuild it
    assert gpu_tokens(http) == BS


def test_gap_beyond_replay_ring_is_unhealed(server, http, publishers, wait_seq):
    pub = publishers(buffer_steps=2)
    register(http, pub)
    wait_seq(server, "e0", pub.publish([block(0)]))
    for i in (1, 2, 3):
        pub.publish([block(i)], drop=True)
    wait_seq(server, "e0", pub.publish([block(4)]))
    st = server.ingestor.stats
    assert st.gaps == 1 and st.replay_failures == 1 and st.resets == 1
    assert gpu_tokens(http) == 0


def test_publisher_restart_connect_mode(server, http, publishers, wait_seq):
    pub = publishers()
    register(http, pub)
    pub.publish([block(0), block(1)])
    wait_seq(server, "e0", pub.publish([block(2)]))
    assert gpu_tokens(http) == 3 * BS
    pub.restart()  # same endpoint, seq restarts at 0, empty cache
    pub.wait_subscribed()
    wait_seq(server, "e0", pub.publish([block(0)]))
    assert server.ingestor.stats.restarts == 1
    assert gpu_tokens(http) == BS  # blocks of the dead process are gone


def test_publisher_restart_bind_mode(server, http, publishers, wait_seq):
    (ep,) = server.zmq_endpoints
    body = {"modelname": "m", "instance_id": "e0", "block_size": BS, "topic": "kv"}
    assert http.post("/register", json=body).status_code == 200
    old = publishers(connect=ep, topic="kv", replay=False)
    old.wait_subscribed()
    old.publish([block(0)])
    wait_seq(server, "e0", old.publish([block(1)]))
    old.close()
    new = publishers(connect=ep, topic="kv", replay=False)
    new.wait_subscribed()
    wait_seq(server, "e0", new.publish([block(3)]))
    assert server.ingestor.stats.restarts == 1 and gpu_tokens(http) == 0


def test_malformed_frames_are_counted_and_skipped(server, http, publishers, wait_seq):
    pub = publishers()
    register(http, pub)
    wait_seq(server, "e0", pub.publish([block(0)]))
    pub.send_raw([b"", (1).to_bytes(8, "big")])  # 2 frames
    pub.send_raw([b"", (1).to_bytes(8, "big"), b"x", b"y"])  # 4 frames
    pub.send_raw([b"", b"\x00" * 7, kvevents.encode_batch([block(1)])])  # 7-byte seq
    pub.publish_payload(b"\xc1garbage")  # undecodable, consumes seq 1
    pub.publish_payload(msgspec.msgpack.encode({"not": "a batch"}))  # seq 2
    pub.publish_payload(msgspec.msgpack.encode([1.0, [{"type": "Bogus"}], 0]))  # seq 3
    seq = pub.publish([block(1)])
    wait_seq(server, "e0", seq)
    st = server.ingestor.stats
    assert st.malformed == 6 and st.gaps == 0 and st.resets == 0
    assert gpu_tokens(http) == 2 * BS


def test_oversized_batches_are_counted_and_skipped(make_server, publishers, wait_seq):
    import httpx
    srv = make_server(max_batch_bytes=4096)
    pub = publishers()
    with httpx.Client(base_url=srv.url, timeout=10) as http:
        register(http, pub)
        wait_seq(srv, "e0", pub.publish([block(0)]))
        big = kvevents.stored(list(range(1, 2000)), [], BS)  # ~18 KB payload
        pub.publish([big])
        wait_seq(srv, "e0", pub.publish([block(1)]))
        st = srv.ingestor.stats
        assert st.oversized == 1 and st.gaps == 0 and pub.replay_requests == 0
        assert gpu_tokens(http) == 2 * BS and srv.conductor.health()["blocks"] == 2


def test_unknown_topic_and_unknown_medium_are_skipped(server, http, publishers, wait_seq):
    (ep,) = server.zmq_endpoints
    assert http.post("/register", json={"modelname": "m", "instance_id": "e0", "block_size": BS,
                                        "topic": "known"}).status_code == 200
    stranger = publishers(connect=ep, topic="stranger", replay=False)
    known = publishers(connect=ep, topic="known", replay=False)
    stranger.wait_subscribed()
    known.wait_subscribed()
    stranger.publish([block(0)])
    known.publish([block(0, medium="tape")])
    wait_seq(server, "e0", known.publish([block(0)]))
    # the stranger's batch may race the known one on a different connection: wait on the counter
    assert server.conductor.wait_until(lambda: server.ingestor.stats.unknown_stream == 1, 10)
    assert gpu_tokens(http) == BS and server.conductor.health()["entries"] == 1


def test_late_registration_catches_up_from_the_replay_ring(server, http, publishers, wait_seq):
    pub = publishers(buffer_steps=3)
    for i in range(5):  # seqs 0..4 published before anyone listens
        pub.publish([block(i)], drop=True)
    register(http, pub)
    wait_seq(server, "e0", pub.publish([block(5)]))  # ring now holds 3..5: 0..2 are gone
    st = server.ingestor.stats
    assert st.replayed == 2 and st.gaps == 0 and pub.replay_requests == 1
    assert server.conductor.health()["entries"] == 3  # blocks 3, 4 (replayed) and 5 (live)
    assert gpu_tokens(http) == 0  # the chain's head is unknown, so no prefix matches
