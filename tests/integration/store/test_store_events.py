"""The store publishes its objects as KV events; a conductor sees pool hits as a CPU tier."""

import pytest

from kvplane.conductor.hashing import HashProfile
from kvplane.store import MasterServer, StoreClient
from kvplane.store.master.pool_events import key_hash

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
BS = 16


def test_key_hash():
    assert key_hash("0x1F") == 31 and key_hash("123") == 123
    assert key_hash("model@rank0@0xff") == 255 and key_hash("a/b/42") == 42
    assert key_hash("not-a-hash") is None and key_hash("") is None
    assert key_hash(str(1 << 70)) == (1 << 70) & ((1 << 64) - 1)


def register_pool_and_engine(http, m: MasterServer) -> None:
    """Register ``m``'s KV events as the shared pool "pool" and an engine "e0" that never
    publishes; wait until the master has the conductor's subscription."""
    r = http.post("/register", json={
        "instance_id": "pool", "type": "kvplane", "modelname": "m", "block_size": BS,
        "endpoint": m.events.endpoint, "replay_endpoint": m.events.replay_endpoint})
    assert r.status_code == 200, r.text
    r = http.post("/register", json={"instance_id": "e0", "modelname": "m", "block_size": BS,
                                     "topic": "kv@e0"})
    assert r.status_code == 200
    m.events.pub.wait_subscribed()


def test_pool_blocks_show_up_as_cpu_tier(server, http, wait_seq):
    hs = list(HashProfile().event_hashes(list(range(3 * BS)), BS))
    with MasterServer(admin_port=None, kv_events_port=0) as m:
        register_pool_and_engine(http, m)
        addr = f"127.0.0.1:{m.port}"
        with StoreClient(master=addr, global_segment_size=1 << 20) as c:
            keys = [f"m@0@{h:#x}" for h in hs[:2]]
            assert c.put_batch(keys, [b"kv"] * 2) == [None, None]
            wait_seq(server, "pool", m.events.pub._seq - 1)
            body = {"model": "m", "seq_hashes": hs, "block_size": BS}
            got = http.post("/query_by_hash", json=body).json()["default"]
            assert got["e0"]["CPU"] == 2 * BS and got["e0"]["GPU"] == 0
            c.remove(keys[1], force=True)
            wait_seq(server, "pool", m.events.pub._seq - 1)
            got = http.post("/query_by_hash", json=body).json()["default"]
            assert got["e0"]["CPU"] == BS


def test_connector_keys_name_their_block_by_the_vllm_hash_once():
    """kvplane's vLLM connectors store one object per block and layer under the block's vLLM
    hash: the block is published once (layer 0, rank 0, group 0) as vLLM's own event hash."""
    import hashlib

    from kvplane.conductor.hashing import low64
    from kvplane.integrations.vllm.offload_plan import ObjectNames, namespace
    from kvplane.integrations.vllm.plan import KeySpace

    h = hashlib.sha256(b"block").digest()
    space = KeySpace("m", "float32", BS, 3, 0, 2)
    assert [key_hash(k) for k in space.block_keys(h)] == [low64(h), None, None]
    assert [key_hash(k) for k in space.of_rank(1).block_keys(h)] == [None] * 3
    for rank in (0, 1):
        names = ObjectNames(namespace("m", "float32", BS, rank, 2), 2)
        got = [key_hash(k) for k in names.of([h + (0).to_bytes(4, "big"),
                                              h + (1).to_bytes(4, "big")])]
        assert got == ([low64(h), None, None, None] if rank == 0 else [None] * 4)


def test_connector_blocks_in_the_pool_show_up_for_every_instance(server, http, wait_seq):
    """End to end: blocks a connector stored (every layer) are a CPU-tier prefix for an
    engine that never held them; removing layer 0 takes the block out."""
    from kvplane.integrations.vllm.plan import KeySpace

    tokens = list(range(3 * BS))
    digests = list(HashProfile().digests(tokens, BS))
    hs = list(HashProfile().event_hashes(tokens, BS))
    space = KeySpace("m", "float32", BS, 2)
    with MasterServer(admin_port=None, kv_events_port=0) as m:
        register_pool_and_engine(http, m)
        with StoreClient(master=f"127.0.0.1:{m.port}", global_segment_size=1 << 20) as c:
            keys = [k for d in digests[:2] for k in space.block_keys(d)]
            assert c.put_batch(keys, [b"kv"] * len(keys)) == [None] * len(keys)
            wait_seq(server, "pool", m.events.pub._seq - 1)
            body = {"model": "m", "seq_hashes": hs, "block_size": BS}
            got = http.post("/query_by_hash", json=body).json()["default"]
            assert got["e0"]["CPU"] == 2 * BS and got["e0"]["GPU"] == 0
            c.remove(space.block_keys(digests[1])[0], force=True)
            wait_seq(server, "pool", m.events.pub._seq - 1)
            got = http.post("/query_by_hash", json=body).json()["default"]
            assert got["e0"]["CPU"] == BS
