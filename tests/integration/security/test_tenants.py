"""Issue 15, findings 12 and 13: segment ownership, and tenants that cannot see each other.

12: only a segment's owner, or the admin token, unmounts it; a client whose segment the admin
    unmounted learns it from its next heartbeat and mounts it again.
13: each tenant has its own token and key namespace: get, put, exists, remove, remove_all,
    remove_by_regex, the admin listing and the KV events of one never show or touch another's.
"""

from __future__ import annotations

import contextlib

import httpx
import pytest
import zmq

from kvplane.common.errors import Timeout, Unauthorized
from kvplane.common.rpc import RpcClient
from kvplane.kvevents import decode_batch
from kvplane.kvevents.secure import topic_of
from kvplane.store import StoreClient
from kvplane.store.errors import InvalidKey, ObjectNotFound
from kvplane.store.master.access import scoped, unscoped
from kvplane.store.master.pool_events import key_hash
from kvplane.store.types import MountReq
from tests.support.services import wait_until
from tests.support.store_procs import tenant_pool

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]
SVC, ADM = "service-token-0123456789", "admin-token-0123456789"
TOK = {"a": "tenant-a-token-0123456789", "b": "tenant-b-token-0123456789"}


@pytest.fixture
def pool():
    with tenant_pool(SVC, TOK, admin_token=ADM, kv_events_port=0) as made:
        yield made


def test_another_client_cannot_unmount_my_segment(pool):
    m, addr, seg = pool
    mine = seg.segments
    with RpcClient(addr, token=SVC) as other:
        with pytest.raises(Unauthorized):
            other.call("unmount", MountReq("someone-else", mine), int)
    assert seg.segment_name in m.state.segments


def test_admin_unmount_makes_the_owner_remount(pool):
    m, addr, seg = pool
    with RpcClient(addr, token=ADM) as admin:
        admin.call("unmount", MountReq("admin", seg.segments), int)
    assert seg.segment_name not in m.state.segments
    wait_until(lambda: seg.segment_name in m.state.segments, 10, "the owner to remount")
    assert seg.remounts >= 1


def test_tenants_cannot_mount_segments(pool):
    _, addr, _ = pool
    with pytest.raises(Unauthorized):
        StoreClient(master=addr, token=TOK["a"], global_segment_size=1 << 20)


def test_tenants_see_and_touch_only_their_own_keys(pool):
    m, addr, _ = pool
    with StoreClient(master=addr, token=TOK["a"], protocol="tcp") as a, \
            StoreClient(master=addr, token=TOK["b"], protocol="tcp") as b, \
            StoreClient(master=addr, token=SVC, protocol="tcp") as d:
        a.put("k", b"a-value")
        assert not b.exists("k") and not d.exists("k")
        with pytest.raises(ObjectNotFound):
            b.get("k")
        b.put("k", b"b-value")  # the same name, b's own object
        d.put("k", b"d-value")
        assert (a.get("k"), b.get("k"), d.get("k")) == (b"a-value", b"b-value", b"d-value")
        b.upsert("k", b"b2")
        assert a.get("k") == b"a-value"
        b.remove("k", force=True)
        assert a.get("k") == b"a-value" and not b.exists("k")
        a.put_batch(["x1", "x2"], [b"1", b"2"])
        assert b.remove_by_regex(".*", force=True) == 0
        b.put("mine", b"m")
        assert b.remove_all(force=True) == 1
        assert a.exists("x1") and a.exists("x2") and d.exists("k")
        with pytest.raises(InvalidKey):
            b.get("\x00a\x00k")  # no way into another namespace by spelling it
        assert a.remove_by_regex("^x", force=True) == 2


def test_admin_listing_is_scoped(pool):
    m, addr, _ = pool
    with StoreClient(master=addr, token=TOK["a"], protocol="tcp") as a, \
            StoreClient(master=addr, token=SVC, protocol="tcp") as d:
        a.put("secret-a", b"1")
        d.put("shared", b"2")
        url = f"{m.http.url}/get_all_keys"

        def keys(token, **params):
            return httpx.get(url, params=params, headers={"X-KVPlane-Token": token}, timeout=5)
        assert keys(TOK["a"]).json() == ["secret-a"]
        assert keys(TOK["b"]).json() == []
        assert keys(SVC).json() == ["shared"]
        assert keys(ADM, tenant="a").json() == ["secret-a"]
        assert keys(TOK["b"], tenant="a").status_code == 403
        q = httpx.get(f"{m.http.url}/query_key", params={"key": "secret-a"},
                      headers={"X-KVPlane-Token": TOK["b"]}, timeout=5)
        assert q.status_code == 404
        seg = httpx.get(f"{m.http.url}/segments", headers={"X-KVPlane-Token": TOK["b"]}, timeout=5)
        assert seg.status_code == 403
        owners = httpx.get(f"{m.http.url}/segments", headers={"X-KVPlane-Token": SVC}, timeout=5)
        assert "client_id" not in owners.json()[0]  # only the admin sees segment owners


def _subscriber(ctx, endpoint: str, token: str) -> zmq.Socket:
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.PLAIN_USERNAME, b"anyone")
    s.setsockopt(zmq.PLAIN_PASSWORD, token.encode())
    s.setsockopt(zmq.SUBSCRIBE, b"")  # asks for everything; gets its own tenant's stream
    s.connect(endpoint)
    return s


def test_kv_events_are_per_tenant(pool):
    m, addr, _ = pool
    ctx = zmq.Context()
    try:
        sub_a = _subscriber(ctx, m.events.endpoint, TOK["a"])
        sub_b = _subscriber(ctx, m.events.endpoint, TOK["b"])
        def both() -> bool:
            with contextlib.suppress(Timeout):
                m.events.secure.wait_subscribed(0.1)
            return {"a", "b"} <= set(m.events.secure.subscribed)
        wait_until(both, 10, "both subscriptions")
        with StoreClient(master=addr, token=TOK["a"], protocol="tcp") as a, \
                StoreClient(master=addr, token=TOK["b"], protocol="tcp") as b:
            a.put("m@0x11", b"x")
            b.put("m@0x22", b"y")
        got = {}
        for name, sub in (("a", sub_a), ("b", sub_b)):
            assert sub.poll(5000), name
            topic, _seq, payload = sub.recv_multipart()
            assert topic == topic_of(name)
            got[name] = [h for ev in decode_batch(payload).events for h in ev.hashes]
            assert not sub.poll(300), f"{name} received another tenant's batch"
        assert got == {"a": [0x11], "b": [0x22]}
    finally:
        ctx.destroy(linger=0)


def test_key_scoping_round_trips():
    for tenant, key in (("default", "k"), ("a", "k"), ("a", "m@0x1f"), ("t-1.x", "")):
        assert unscoped(scoped(tenant, key)) == (tenant, key)
    assert scoped("default", "plain") == "plain"
    assert key_hash(unscoped(scoped("a", "m@0x1f"))[1]) == 0x1F
