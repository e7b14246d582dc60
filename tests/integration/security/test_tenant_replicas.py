"""Issue 15, finding 13, for the Mooncake-compat master calls (replica descriptors, replica clear,
copy/move tasks, upsert) and the compat facade's ``tenant_id``: one tenant can neither see nor
touch another's keys, or its tasks, through these calls either.
"""

from __future__ import annotations

import pytest

from kvplane.common.errors import Unauthorized
from kvplane.common.rpc import RpcClient
from kvplane.compat.mooncake import MooncakeDistributedStore
from kvplane.store import MasterServer, StoreClient
from kvplane.store.client.replica_ops import ReplicaOps
from kvplane.store.errors import InvalidKey, ObjectNotFound
from kvplane.store.master.tasks import TASK_NOT_FOUND
from kvplane.store.replica_types import (
    DescRep,
    ReplicaClearReq,
    TaskCreateRep,
    TaskCreateReq,
    TaskDoneReq,
    TaskInfo,
    TaskReq,
    TaskWork,
)
from kvplane.store.types import KeysReq, MountReq, PingRep, PingReq
from tests.support.services import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]
SVC, ADM = "service-token-0123456789", "admin-token-0123456789"
TOK = {"a": "tenant-a-token-0123456789", "b": "tenant-b-token-0123456789"}
NOT_FOUND = ObjectNotFound.code


@pytest.fixture
def pool():
    with MasterServer(token=SVC, admin_token=ADM, tenants=TOK) as m:
        addr = f"127.0.0.1:{m.port}"
        peers = tuple(TOK.values())
        with StoreClient(master=addr, token=SVC, global_segment_size=8 << 20,
                         peer_tokens=peers) as s1, \
                StoreClient(master=addr, token=SVC, global_segment_size=8 << 20,
                            peer_tokens=peers) as s2, \
                StoreClient(master=addr, token=TOK["a"], protocol="tcp") as a, \
                StoreClient(master=addr, token=TOK["b"], protocol="tcp") as b, \
                StoreClient(master=addr, token=SVC, protocol="tcp") as d:
            yield m, addr, (s1, s2), a, b, d


def _descs(client: StoreClient, keys: list[str]) -> list[int]:
    rep = client.rpc.call("replica_descs", KeysReq(client.config.client_id, keys), DescRep)
    return [r.code for r in rep.results]


def test_replica_descriptors_are_scoped(pool):
    _, _, _, a, b, d = pool
    d.put("k", b"default")
    a.put("ka", b"tenant a")
    assert _descs(b, ["k", "ka"]) == [NOT_FOUND, NOT_FOUND]
    assert _descs(a, ["k", "ka"]) == [NOT_FOUND, 0]
    assert _descs(d, ["k", "ka"]) == [0, NOT_FOUND]
    with pytest.raises(InvalidKey):
        _descs(b, ["\x00a\x00ka"])  # no way into another namespace by spelling it
    with pytest.raises(InvalidKey):
        _descs(d, ["\x00a\x00ka"])


def test_replica_clear_is_scoped(pool):
    m, _, _, a, b, d = pool
    a.put("x", b"1")
    d.put("x", b"2")
    # b even knows a's client id: the key it names is still b's own "x", which does not exist
    for who in (b, d):
        cleared = who.rpc.call("replica_clear", ReplicaClearReq(a.config.client_id, ["x"]),
                               list[str])
        assert cleared == []
    # (looked up in the master's table: get and exists take a lease, which blocks a clear)
    assert "\x00a\x00x" in m.state.objects and "x" in m.state.objects
    assert ReplicaOps(a).clear(["x"]) == ["x"]
    assert not a.exists("x") and d.get("x") == b"2"


def test_upsert_stays_in_its_tenant(pool):
    _, _, _, a, b, d = pool
    d.put("u", b"default")
    a.upsert("u", b"a1")
    b.upsert("u", b"b1")
    a.upsert("u", b"a2")
    assert (a.get("u"), b.get("u"), d.get("u")) == (b"a2", b"b1", b"default")


def test_another_tenants_task_does_not_exist(pool):
    _, _, (s1, s2), a, b, d = pool
    a.put("t", b"tenant a's bytes")
    d.put("t", b"default bytes")
    holder = {r[0] for r in _internal_replicas(pool, "\x00a\x00t")}
    target = next(s.segment_name for s in (s1, s2) if s.segment_name not in holder)
    # b cannot queue a task on a key it does not have, although "t" exists for a and default
    rep = b.rpc.call("task_create", TaskCreateReq(b.config.client_id, "copy", "t", [target]),
                     TaskCreateRep)
    assert rep.code == NOT_FOUND
    rep = a.rpc.call("task_create", TaskCreateReq(a.config.client_id, "copy", "t", [target]),
                     TaskCreateRep)
    assert rep.code == 0
    tid = rep.task
    for who in (b, d):  # another tenant (and the default one) cannot run, finish or query it
        cid = who.config.client_id
        assert who.rpc.call("task_query", TaskReq(cid, tid), TaskInfo).code == TASK_NOT_FOUND
        assert who.rpc.call("task_start", TaskReq(cid, tid), TaskWork).code == TASK_NOT_FOUND
        assert who.rpc.call("task_done", TaskDoneReq(cid, tid, [True]), int) == TASK_NOT_FOUND
    info = a.rpc.call("task_query", TaskReq(a.config.client_id, tid), TaskInfo)
    assert info.code == 0 and info.status == "PENDING"
    # a's own task runs, for a, from a's object
    work = a.rpc.call("task_start", TaskReq(a.config.client_id, tid), TaskWork)
    assert work.code == 0 and work.size == len(b"tenant a's bytes")
    mine = a.rpc.call("task_query", TaskReq(a.config.client_id, tid), TaskInfo)
    assert mine.assigned_client == a.config.client_id
    # the same tenant, another client: runner hidden
    with RpcClient(pool[1], token=TOK["a"], timeout=5) as other_a:
        seen = other_a.call("task_query", TaskReq("another-client", tid), TaskInfo)
    assert seen.code == 0 and seen.assigned_client == ""


def test_a_tenants_copy_task_runs_end_to_end(pool):
    _, _, (s1, s2), a, b, _ = pool
    a.put("c", b"copy me" * 100)
    b.put("c", b"not this")
    holder = {r[0] for r in _internal_replicas(pool, "\x00a\x00c")}
    target = next(s.segment_name for s in (s1, s2) if s.segment_name not in holder)
    ops = ReplicaOps(a)
    try:
        rep = ops.create_task("copy", "c", [target])
        assert rep.code == 0
        wait_until(lambda: ops.query_task(rep.task).status in ("SUCCESS", "FAILED"), 30,
                   "the copy task to finish")
        assert ops.query_task(rep.task).status == "SUCCESS"
    finally:
        ops.close()
    assert {r[0] for r in _internal_replicas(pool, "\x00a\x00c")} == holder | {target}
    assert len(_internal_replicas(pool, "\x00b\x00c")) == 1
    assert a.get("c") == b"copy me" * 100 and b.get("c") == b"not this"


def test_a_tenant_cannot_act_as_a_segment_holder(pool):
    """A tenant that learned a segment owner's client id can neither heartbeat as it (that
    would acknowledge the segment's fences and take its repair work) nor mount as it."""
    _, _, (s1, _), a, _, d = pool
    owner = s1.config.client_id
    with pytest.raises(Unauthorized):
        a.rpc.call("ping", PingReq(owner), PingRep)
    with pytest.raises(Unauthorized):
        a.rpc.call("mount", MountReq(owner, []), int)
    assert a.rpc.call("ping", PingReq(a.config.client_id), PingRep).status == "ok"
    assert d.rpc.call("ping", PingReq(d.config.client_id), PingRep).status == "ok"


def _internal_replicas(pool, internal: str) -> list:
    m = pool[0]
    with m.lock:
        return list(m.state.objects[internal].replicas)


# -- the compat facade's tenant_id ---------------------------------------------------------------
def _setup(addr: str, tenant: str, segment: int = 0) -> tuple[MooncakeDistributedStore, int]:
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", segment, 16 << 20, "tcp", "", addr,
                     tenant_id=tenant)
    return store, rc


def test_compat_tenant_id_maps_onto_the_tokens_tenant(pool, monkeypatch):
    _, addr, _, a, b, d = pool
    monkeypatch.setenv("KVPLANE_TOKEN", TOK["a"])
    store, rc = _setup(addr, "a")
    try:
        assert rc == 0
        assert store.put("ck", b"via compat") == 0
        assert store.get("ck") == b"via compat"
    finally:
        store.close()
    assert a.get("ck") == b"via compat"
    assert not b.exists("ck") and not d.exists("ck")
    for tenant, segment in (("b", 0), ("default", 0), ("a", 16 << 20)):
        store, rc = _setup(addr, tenant, segment)
        store.close()
        assert rc == -600, (tenant, segment)  # a's token names tenant a only; tenants mount nothing
    monkeypatch.setenv("KVPLANE_TOKEN", SVC)
    store, rc = _setup(addr, "default")
    try:
        assert rc == 0 and store.get("ck") == b""  # the default namespace has no "ck"
    finally:
        store.close()
