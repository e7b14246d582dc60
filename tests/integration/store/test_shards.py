"""A sharded pool in one process: routing by slot, shares of a segment, redirects of a stale
map (``kvplane.store.shard``; docs/store.md, "Sharded metadata")."""

import pytest

from kvplane.common.rpc import RpcClient
from kvplane.store.client.client import StoreClient
from kvplane.store.errors import WrongShard
from kvplane.store.shard.link import ShardedLink
from kvplane.store.shard.server import local_pool
from kvplane.store.shard.slots import SLOTS, owners, reassign, slot_of
from kvplane.store.types import KeysReq

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
SEG = 32 << 20


@pytest.fixture(scope="module")
def pool():
    with local_pool(2, admin_port=None) as shards:
        with StoreClient(master=shards[0].address, global_segment_size=SEG,
                         protocol="tcp") as host:
            yield shards, host


def value(key):
    return key.encode() * 7


def test_keys_live_on_the_shard_that_owns_their_slot(pool):
    shards, _ = pool
    with StoreClient(master=shards[1].address, protocol="auto") as c:  # any shard is a seed
        assert isinstance(c.rpc, ShardedLink)
        keys = [f"route-{i}" for i in range(64)]
        assert c.put_batch(keys, [value(k) for k in keys]) == [None] * 64
        own = owners(c.rpc.map)
        for k in keys:
            holder = shards[own[slot_of(k)]].master.state.objects
            other = shards[1 - own[slot_of(k)]].master.state.objects
            assert k in holder and k not in other
        assert all(len([k for k in keys if own[slot_of(k)] == i]) > 10 for i in (0, 1))
        assert c.get_batch(keys) == [value(k) for k in keys]
        assert c.batch_exists(keys + ["route-none"]) == [True] * 64 + [False]
        assert [c.get(k) for k in keys[:8]] == [value(k) for k in keys[:8]]
        assert sorted(c.list_keys("route-")) == sorted(keys)
        assert c.list_keys("route-", limit=10) == sorted(keys)[:10]
        assert c.remove_by_regex("^route-", force=True) == 64
        assert not any(c.batch_exists(keys))


def test_each_shard_allocates_in_its_own_share_of_the_segment(pool):
    shards, host = pool
    name = host.segment_name
    spans = sorted((s.master.state.segments[name].info.base,
                    s.master.state.segments[name].info.size) for s in shards)
    seg = host.segments[0]
    assert spans[0][0] == seg.base and spans[1][0] == spans[0][0] + spans[0][1]
    assert spans[1][0] + spans[1][1] == seg.base + seg.size  # disjoint, covering the segment
    with StoreClient(master=shards[0].address, protocol="tcp") as c:
        keys = [f"share-{i}" for i in range(40)]
        c.put_batch(keys, [value(k) for k in keys])
        for s in shards:
            seg_of = s.master.state.segments[name].info
            for k, obj in s.master.state.objects.items():
                if k.startswith("share-"):
                    off = obj.replicas[0][1]
                    assert 0 <= off < seg_of.size  # inside this shard's share
        c.remove_by_regex("^share-", force=True)


def test_a_master_refuses_a_key_of_a_slot_it_does_not_own(pool):
    shards, _ = pool
    own = owners(shards[0].role.map)
    key = next(f"wrong-{i}" for i in range(100) if own[slot_of(f"wrong-{i}")] == 1)
    with RpcClient(shards[0].address) as rpc:
        with pytest.raises(WrongShard, match="served by shard 1"):
            rpc.call("exist", KeysReq("probe", [key]), object)
        with pytest.raises(WrongShard):  # a batch with one such key is refused whole
            rpc.call("exist", KeysReq("probe", ["x", key]), object)


def test_a_client_with_a_stale_map_is_redirected_never_answered_wrongly(pool):
    shards, _ = pool
    with StoreClient(master=shards[0].address, protocol="tcp") as c:
        old = c.rpc.map
        own = owners(old)
        key = next(f"stale-{i}" for i in range(200) if own[slot_of(f"stale-{i}")] == 0)
        # the slot moves to shard 1 behind the client's back (empty: nothing to copy)
        moved = reassign(old, [slot_of(key)], 1)
        for s in shards:
            s.install(moved)
        try:
            c.put(key, value(key))  # sent to shard 0 by the old map: redirected
            assert c.rpc.map.version == moved.version and c.rpc.refreshes == 1
            assert key in shards[1].master.state.objects
            assert key not in shards[0].master.state.objects
            assert c.get(key) == value(key)
        finally:
            c.remove(key, force=True)
            back = reassign(moved, [slot_of(key)], 0)
            for s in shards:
                s.install(back)


def test_an_unsharded_master_gets_a_plain_link():
    from kvplane.store.client.link import MasterLink
    from kvplane.store.master.server import MasterServer

    with MasterServer(admin_port=None) as m:
        with StoreClient(master=f"127.0.0.1:{m.port}", protocol="tcp",
                         global_segment_size=8 << 20) as c:
            assert type(c.rpc) is MasterLink
            c.put("plain", b"v")
            assert c.get("plain") == b"v"
    assert SLOTS == 16384


def test_every_shard_answers_status_for_the_whole_pool():
    import httpx

    with local_pool(2) as shards:
        with StoreClient(master=shards[0].address, global_segment_size=SEG,
                         protocol="tcp") as host:
            keys = [f"st-{i}" for i in range(30)]
            host.put_batch(keys, [b"v" * 100] * 30)
            per = [len(s.master.state.objects) for s in shards]
            assert sum(per) == 30 and min(per) > 0
            for s in shards:
                doc = httpx.get(f"http://127.0.0.1:{s.master.http.port}/status?history=1",
                                trust_env=False).json()
                assert doc["objects"]["objects"] == 30
                assert [m["shard"] for m in doc["masters"]] == [0, 1]
                (seg,) = doc["segments"]  # one segment, its two shares joined
                assert seg["capacity_bytes"] == host.segments[0].size
                assert seg["replicas"] == 30 and seg["status"] == "alive"
                assert doc["shard"]["id"] == s.role.me
                assert [x["objects"] for x in doc["shard"]["shards"]] == per
            shards[1].close()  # a shard that does not answer is listed, not fatal
            doc = httpx.get(f"http://127.0.0.1:{shards[0].master.http.port}/status",
                            trust_env=False).json()
            assert doc["objects"]["objects"] == per[0]
            assert doc["shard"]["shards"][1] == {"id": 1, "reachable": False}
