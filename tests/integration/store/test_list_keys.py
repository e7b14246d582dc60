"""The master's ``list_keys`` RPC and ``StoreClient.list_keys``: a real master on 127.0.0.1 port
0 with a segment client, as tenants and as the service token.

Checked: prefix filtering, ascending order, only complete objects, removed keys gone, the
caller's limit, the per-answer caps (keys and bytes, lowered here so a few keys span pages)
with the client paging through them, tenant scoping, and refused arguments.
"""

from __future__ import annotations

import pytest

from kvplane.common.errors import Unauthorized
from kvplane.common.rpc import RpcClient
from kvplane.store import StoreClient
from kvplane.store import types as store_types
from kvplane.store.errors import InvalidKey, InvalidParams
from kvplane.store.types import ListKeysRep, ListKeysReq, PutStartReq, ReplicateConfig
from tests.support.store_procs import tenant_pool

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
SVC = "service-token-0123456789"
TOK = {"a": "tenant-a-token-0123456789"}


@pytest.fixture
def pool():
    with tenant_pool(SVC, TOK) as made:
        yield made


def test_prefix_order_and_removal(pool):
    m, _, c = pool
    for k in ("p/b", "p/a", "q/a", "p/c", "pp"):
        c.put(k, b"v")
    assert c.list_keys("p/") == ["p/a", "p/b", "p/c"]
    assert c.list_keys("p") == ["p/a", "p/b", "p/c", "pp"]
    assert c.list_keys() == ["p/a", "p/b", "p/c", "pp", "q/a"]
    assert c.list_keys("none/") == []
    c.remove("p/b")
    assert c.list_keys("p/") == ["p/a", "p/c"]
    assert c.remove_by_regex("^p") == 3
    assert c.list_keys() == ["q/a"]
    assert m.rpc_calls["list_keys"] == 6


def test_incomplete_objects_are_not_listed(pool):
    _, addr, c = pool
    c.put("done", b"v")
    with RpcClient(addr, token=SVC) as rpc:  # a put that started and never ended
        rpc.call("put_start", PutStartReq("writer", ["half"], [8], ReplicateConfig()),
                 store_types.ResultsRep)
    assert c.list_keys() == ["done"]


def test_limit_is_enforced(pool):
    _, _, c = pool
    keys = [f"lim-{i:02d}" for i in range(12)]
    c.put_batch(keys, [b"x"] * len(keys))
    assert c.list_keys("lim-", limit=5) == keys[:5]
    assert c.list_keys("lim-", limit=0) == []
    assert c.list_keys("lim-", limit=100) == keys
    with pytest.raises(InvalidParams):
        c.list_keys(limit=-1)


def test_answers_are_capped_and_the_client_pages(pool, monkeypatch):
    m, addr, c = pool
    keys = [f"page-{i:02d}" for i in range(10)]
    c.put_batch(keys, [b"x"] * len(keys))
    monkeypatch.setattr(store_types, "MAX_LIST_KEYS", 4)  # the master is in this process
    with RpcClient(addr, token=SVC) as rpc:
        rep = rpc.call("list_keys", ListKeysReq("lister", "page-", 1000), ListKeysRep)
        assert (rep.keys, rep.more) == (keys[:4], True)  # a huge limit is cut to the cap
        rep = rpc.call("list_keys", ListKeysReq("lister", "page-", 0, "page-07"), ListKeysRep)
        assert (rep.keys, rep.more) == (keys[8:], False)
    before = m.rpc_calls["list_keys"]
    assert c.list_keys("page-") == keys
    assert m.rpc_calls["list_keys"] - before == 3  # 4 + 4 + 2
    assert c.list_keys("page-", limit=6) == keys[:6]
    monkeypatch.setattr(store_types, "MAX_LIST_BYTES", 3 * len("page-00"))  # 3 keys per answer
    with RpcClient(addr, token=SVC) as rpc:
        rep = rpc.call("list_keys", ListKeysReq("lister", "page-"), ListKeysRep)
        assert (rep.keys, rep.more) == (keys[:3], True)
    assert c.list_keys("page-") == keys


def test_tenants_list_only_their_own_keys(pool):
    _, addr, svc = pool
    svc.put("shared-name", b"d")
    svc.put("svc-only", b"d")
    with StoreClient(master=addr, token=TOK["a"], protocol="tcp") as a:
        a.put("shared-name", b"a")
        a.put("a-only", b"a")
        assert a.list_keys() == ["a-only", "shared-name"]
        assert a.list_keys("s") == ["shared-name"]
    assert svc.list_keys() == ["shared-name", "svc-only"]


def test_bad_arguments_and_tokens_are_refused(pool):
    _, addr, c = pool
    with pytest.raises(InvalidKey):
        c.list_keys("\x00a\x00")  # another tenant's internal spelling
    with pytest.raises(InvalidKey):
        c.list_keys("k" * (store_types.MAX_KEY + 1))
    with pytest.raises(Unauthorized):
        with RpcClient(addr, token="wrong-token-0123456789") as rpc:
            rpc.call("list_keys", ListKeysReq("x"), ListKeysRep)
