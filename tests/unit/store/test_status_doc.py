"""The master's status document and its ring of samples (pure: a replayed timeline)."""

import pytest

from kvplane.common.http_guard import Refused, parse_head, query_token
from kvplane.store.master.config import MasterConfig
from kvplane.store.master.state import MasterState
from kvplane.store.master.status import History, document, op_totals, sample
from kvplane.store.types import ReplicateConfig, SegmentInfo

pytestmark = pytest.mark.timeout(10)


def state_with_two_segments(now=0.0):
    st = MasterState(MasterConfig(client_ttl=10.0))
    st.mount("c1", [SegmentInfo("s1", 0, 1 << 20, "c1", "e1", "h1")], now)
    st.mount("c2", [SegmentInfo("s2", 0, 1 << 20, "c2", "e2", "h2")], now)
    return st


def test_document_counts_objects_replicas_and_liveness():
    st = state_with_two_segments()
    for k in ("a", "b"):
        assert st.put_start(k, 1000, ReplicateConfig(replica_num=2), 0.0).code == 0
        assert st.put_end(k, 0.0) == 0
    assert st.put_start("pending", 10, ReplicateConfig(), 0.0).code == 0
    st.ping("c1", 5.0)  # c2 silent since 0: late past half the TTL
    st.suspect(["s1"], 5.5)
    doc = document(st, History(), {"put_start": 3, "put_committed": 2}, {"put_start": 3}, 6.0,
                   100.0, {"address": "m"})
    assert doc["objects"] == {"objects": 2, "pending_puts": 1, "replicas": 4, "bytes": 2000,
                              "under_replicated": 0, "repairs_pending": 0, "hard_pinned": 0}
    rows = {r["name"]: r for r in doc["segments"]}
    assert rows["s1"]["status"] == "suspect" and rows["s2"]["status"] == "late"
    assert rows["s1"]["heartbeat_age_s"] == 1.0 and rows["s2"]["heartbeat_age_s"] == 6.0
    assert rows["s1"]["replicas"] == 3 and rows["s2"]["replicas"] == 2  # pending put on one
    assert "client_id" not in rows["s1"]
    assert doc["used_bytes"] == rows["s1"]["used_bytes"] + rows["s2"]["used_bytes"] > 0
    assert doc["ops"]["total"]["put"] == 2 and "history" not in doc  # committed, not started
    admin = document(st, History(), {}, {}, 6.0, 100.0, {}, admin=True, with_history=True)
    assert admin["segments"][0]["client_id"] == "c1" and admin["history"] == []
    st.ping("c2", 6.0)
    st2 = document(st, History(), {}, {}, 6.5, 100.0, {})
    assert {r["name"]: r["status"] for r in st2["segments"]}["s2"] == "alive"


def test_history_rates_over_the_window_and_bounded():
    st = state_with_two_segments()
    h = History(every=1.0, keep=5)
    calls = {}
    for t in range(10):
        calls["get_replicas"] = 10 * t  # 10 keys/s
        calls["remove"] = t  # 1 key/s
        if h.due(float(t)):
            h.add(sample(st, calls, float(t), 1000.0 + t))
        st.evicted = 2 * t
    assert len(h.samples) == 5 and h.samples[0].t == 5.0
    now = sample(st, {"get_replicas": 100, "remove": 10}, 10.0, 1010.0)
    rates = h.rates(now)
    assert rates["get"] == 10.0 and rates["remove"] == 1.0 and rates["put"] == 0.0
    assert rates["evictions"] == 2.0  # 8 at the oldest sample (t=5), 18 now
    assert History().rates(now) == {"put": 0.0, "get": 0.0, "exist": 0.0, "remove": 0.0, "evictions": 0.0}
    assert not h.due(9.5) and h.due(10.0)


def test_op_totals_group_methods():
    assert op_totals({"put_start": 5, "put_committed": 4, "remove": 1, "remove_regex": 2,
                      "ping": 9}) == {"put": 4, "get": 0, "exist": 0, "remove": 3}


def test_query_token_only_on_the_dashboard():
    assert query_token("/dashboard", "token=abc&x=1") == "abc"
    assert query_token("/status", "token=abc") == ""
    assert query_token("/dashboard", "&".join(f"f{i}=1" for i in range(40))) == ""
    check = {"abc": object()}.get
    head = b"GET /dashboard?token=abc HTTP/1.1\r\nHost: x\r\n\r\n"
    assert parse_head(head, check).principal is not None
    with pytest.raises(Refused):
        parse_head(b"GET /status?token=abc HTTP/1.1\r\nHost: x\r\n\r\n", check)
    with pytest.raises(Refused):
        parse_head(b"GET /dashboard?token=nope HTTP/1.1\r\nHost: x\r\n\r\n", check)
