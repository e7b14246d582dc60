"""The store end to end: master + segment processes + client processes on 127.0.0.1."""

import json

import httpx
import numpy as np
import pytest

from kvplane.store.client.client import StoreClient
from kvplane.store.errors import InvalidParams, ObjectHasLease, ObjectNotFound
from kvplane.store.master.server import MasterServer
from kvplane.store.types import ReplicateConfig
from tests.support.auth import headers
from tests.support.store_client_proc import value_of
from tests.support.store_procs import spawn_master, spawn_segment, spawn_worker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]
MB = 1 << 20


@pytest.fixture(scope="module")
def cluster():
    with spawn_master() as m:
        addr = m.info["master"]
        with spawn_segment(addr) as s1, spawn_segment(addr) as s2:
            yield {"master": addr, "admin": m.info["admin_port"], "segments": [s1, s2]}


def ask(proc, **cmd):
    return proc.ask(json.dumps(cmd), timeout=60)["result"]


def test_two_clients_two_segments(cluster):
    with spawn_worker(cluster["master"], "--protocol", "tcp") as w1, \
            spawn_worker(cluster["master"]) as w2:
        keys = [f"tc-{i}" for i in range(20)]
        assert ask(w1, op="put", keys=keys, size=100_000, replicas=2) == [0] * 20
        assert set(ask(w2, op="check", keys={k: 100_000 for k in keys}).values()) == {"ok"}
        detail = httpx.get(f"http://127.0.0.1:{cluster['admin']}/query_key",
                           params={"key": "tc-0"}, headers=headers()).json()
        assert len({d["segment"] for d in detail["data"]}) == 2  # two distinct segments
        for p in cluster["segments"]:  # every segment process serves its own metrics
            text = httpx.get(f"http://127.0.0.1:{p.info['metrics_port']}/metrics", headers=headers()).text
            assert "kvplane_transfer_server_frames_total" in text
        segs = httpx.get(f"http://127.0.0.1:{cluster['admin']}/get_segments_detail",
                         headers=headers()).json()
        assert {s["segment_name"] for s in segs} == {p.info["segment"] for p in cluster["segments"]}
        assert all(s["allocator_used_bytes"] > 0 for s in segs)


@pytest.fixture
def client(cluster):
    with StoreClient(master=cluster["master"], protocol="tcp") as c:
        yield c


def test_put_semantics(client):
    client.put("sem-a", b"one")
    client.put("sem-a", b"two")  # exists: success, no overwrite
    assert client.get("sem-a") == b"one"
    client.upsert("sem-a", b"three!")
    assert client.get("sem-a") == b"three!"
    assert client.get_size("sem-a") == 6
    assert client.exists("sem-a") is True and client.exists("sem-none") is False
    assert client.batch_exists(["sem-a", "sem-none"]) == [True, False]
    with pytest.raises(ObjectNotFound, match="sem-none"):
        client.get("sem-none")
    with pytest.raises(ObjectNotFound):
        client.get_size("sem-none")
    got = client.get_batch(["sem-a", "sem-none"])
    assert got[0] == b"three!" and isinstance(got[1], ObjectNotFound)


def test_leases_block_remove(client):
    client.put("lease-a", b"x")
    client.get("lease-a")
    with pytest.raises(ObjectHasLease):
        client.remove("lease-a")
    client.remove("lease-a", force=True)
    with pytest.raises(ObjectNotFound):
        client.remove("lease-a")
    assert [type(r) for r in client.batch_remove(["lease-a"])] == [ObjectNotFound]


def test_regex_and_remove_all(client):
    client.put_batch([f"rx-{i}" for i in range(5)] + ["other-1"], [b"v"] * 6)
    assert client.remove_by_regex("^rx-", force=True) == 5
    assert client.exists("other-1")


def test_zero_copy_batch(client):
    src = np.concatenate([value_of(f"zc-{i}", MB) for i in range(4)])
    dst = np.zeros_like(src)
    client.register_buffer(src)
    client.register_buffer(dst)
    keys = [f"zc-{i}" for i in range(4)]
    addrs = [src.ctypes.data + i * MB for i in range(4)]
    assert client.batch_put_from(keys, addrs, [MB] * 4) == [None] * 4
    got = client.batch_get_into(keys, [dst.ctypes.data + i * MB for i in range(4)], [MB] * 4)
    assert got == [MB] * 4 and np.array_equal(src, dst)
    with pytest.raises(InvalidParams):
        client.get_into("zc-0", dst.ctypes.data, 100)  # buffer too small
    with pytest.raises(ObjectNotFound):
        client.get_into("zc-none", dst.ctypes.data, MB)


def test_health_check(client):
    client.health_check()  # raises when the master is unreachable (tests/fault)


def test_same_host_replica_is_read_through_shared_memory():
    with MasterServer(admin_port=None) as m:
        addr = f"127.0.0.1:{m.port}"
        with StoreClient(master=addr, global_segment_size=8 * MB) as seg, \
                StoreClient(master=addr, protocol="auto") as c:
            c.put("shm-k", value_of("shm-k", 2 * MB).tobytes())
            frames = seg.engine._server.frames
            got = c.get("shm-k")
            assert np.array_equal(np.frombuffer(got, np.uint8), value_of("shm-k", 2 * MB))
            assert seg.engine._server.frames == frames  # no TCP frame served the read
            with StoreClient(master=addr, protocol="tcp") as t:
                assert t.get("shm-k") == got
            assert seg.engine._server.frames > frames


def test_replicate_config_and_metrics(cluster, client):
    cfg = ReplicateConfig(replica_num=2, with_hard_pin=True)
    client.put("pin-k", b"p", cfg)
    assert client.get("pin-k") == b"p"
    text = httpx.get(f"http://127.0.0.1:{cluster['admin']}/metrics/", headers=headers()).text
    assert "master_key_count" in text and "master_rpc_requests_total" in text
    # plain `curl http://HOST:ADMIN/metrics` (no -L): the exposition itself, not a 307
    plain = httpx.get(f"http://127.0.0.1:{cluster['admin']}/metrics", headers=headers(),
                      follow_redirects=False)
    assert plain.status_code == 200 and "master_key_count" in plain.text
    assert plain.headers["content-type"].startswith("text/plain")
    assert httpx.get(f"http://127.0.0.1:{cluster['admin']}/metrics").status_code == 401
    assert httpx.get(f"http://127.0.0.1:{cluster['admin']}/health").json()["ready"] is True
