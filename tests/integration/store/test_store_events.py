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


def test_pool_blocks_show_up_as_cpu_tier(server, http, wait_seq):
    hs = list(HashProfile().event_hashes(list(range(3 * BS)), BS))
    with MasterServer(admin_port=None, kv_events_port=0) as m:
        r = http.post("/register", json={
            "instance_id": "pool", "type": "kvplane", "modelname": "m", "block_size": BS,
            "endpoint": m.events.endpoint, "replay_endpoint": m.events.replay_endpoint})
        assert r.status_code == 200, r.text
        r = http.post("/register", json={"instance_id": "e0", "modelname": "m", "block_size": BS,
                                         "topic": "kv@e0"})
        assert r.status_code == 200
        m.events.pub.wait_subscribed()
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
