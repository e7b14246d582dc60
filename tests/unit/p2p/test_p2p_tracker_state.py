"""TrackerState: versions, leases, holders that appear as chunks arrive, failures, collection."""

import pytest

from kvplane.common.errors import Conflict, InvalidArgument, NotFound
from kvplane.p2p import manifest as mf
from kvplane.p2p.tracker import TrackerState

pytestmark = pytest.mark.timeout(10)


def manifest(name="m", chunks=4, version=0):
    return mf.build(name, version, [mf.Item("a", chunks * 4)], 4, [mf.digest(b"x")] * chunks)


def setup(chunks=4, **kw):
    st = TrackerState(**kw)
    v = st.publish(manifest(chunks=chunks), "pub", [1000 + 4 * i for i in range(chunks)], now=0.0)
    return st, v


def test_publish_numbers_versions_and_refuses_older_ones():
    st, v = setup()
    assert v == 1
    assert st.publish(manifest(), "pub", [0] * 4, now=1.0) == 2
    with pytest.raises(Conflict):
        st.publish(manifest(version=2), "pub", [0] * 4, now=1.0)
    with pytest.raises(InvalidArgument):
        st.publish(manifest(), "pub", [0], now=1.0)


def test_a_chunk_reported_done_makes_the_reader_a_holder_at_once():
    st, v = setup()
    st.open("m", 0, "r1", now=1.0)
    c = st.claim("m", v, "r1", now=1.0, addrs=[5000, 5004, 5008, 5012], want=2)
    assert len(c.assign) == 2 and c.left == 4
    first = c.assign[0][0]
    st.claim("m", v, "r1", now=1.1, done=[(first, "pub")])
    assert st.objects["m"][v].holders[first] == {"pub": 1000 + 4 * first, "r1": 5000 + 4 * first}
    st.open("m", 0, "r2", now=1.2)
    got = st.claim("m", v, "r2", now=1.2, addrs=[0] * 4, want=4).assign
    assert (first, "r1", 5000 + 4 * first) in got  # r1 serves before it has everything


def test_reader_never_gets_itself_or_more_than_the_slots():
    st, v = setup(chunks=8, max_uploads=2)
    st.open("m", 0, "r1", now=0.0)
    c = st.claim("m", v, "r1", now=0.0, addrs=list(range(8)), want=8)
    assert len(c.assign) == 2 and all(h == "pub" for _, h, _ in c.assign)


def test_corrupt_report_removes_that_copy_and_unreachable_suspends_the_holder():
    st, v = setup(chunks=2)
    for r in ("a", "b"):
        st.open("m", 0, r, now=0.0)
        st.claim("m", v, r, now=0.0, addrs=[10, 20], want=0)
    st.objects["m"][v].readers["a"].inflight = {0: "pub"}
    st.holders["pub"].load = 1
    st.claim("m", v, "a", now=1.0, failed=[(0, "pub", "corrupt")])
    assert "pub" not in st.objects["m"][v].holders[0] and st.holders["pub"].load == 0
    st.claim("m", v, "b", now=1.0, failed=[(1, "pub", "unreachable")])
    assert st.status("m", v)["suspects"] == ["pub"]
    assert st.claim("m", v, "b", now=1.1, want=2).assign == []  # suspended until it heartbeats
    st.heartbeat("pub", [("m", v)], now=2.0)
    assert st.claim("m", v, "b", now=2.1, want=2).assign == [(1, "pub", 1004)]
    with pytest.raises(InvalidArgument):
        st.claim("m", v, "b", now=2.2, failed=[(1, "pub", "because")])


def test_chunk_with_no_holder_left_is_reported_unavailable():
    st, v = setup(chunks=2)
    st.open("m", 0, "r", now=0.0)
    st.withdraw("m", v, "pub")
    assert st.claim("m", v, "r", now=0.0, addrs=[0, 0], want=2).unavailable == [0, 1]


def test_old_version_lives_while_leased_then_is_collected_and_holders_told():
    st, v1 = setup()
    st.open("m", v1, "reader", now=0.0)
    v2 = st.publish(manifest(), "pub", [0] * 4, now=1.0)
    assert st.expire(now=2.0) == []  # retired but leased
    assert st.heartbeat("pub", [("m", v1), ("m", v2)], now=2.0) == []
    st.close("m", v1, "reader")
    assert st.expire(now=3.0) == [("m", v1)]
    assert st.heartbeat("pub", [("m", v1), ("m", v2)], now=3.0) == [("m", v1)]
    with pytest.raises(NotFound):
        st.open("m", v1, "late", now=3.0)


def test_leases_expire_and_release_their_load():
    st, v = setup(lease_ttl=5.0)
    st.open("m", 0, "r", now=0.0)
    st.claim("m", v, "r", now=0.0, addrs=[0] * 4, want=2)
    assert st.holders["pub"].load == 2
    st.publish(manifest(), "pub", [0] * 4, now=1.0)
    st.heartbeat("pub", [], now=6.0)
    assert st.expire(now=6.0) == [("m", v)] and st.holders["pub"].load == 0


def test_silent_holders_are_dropped():
    st, v = setup(holder_ttl=2.0)
    st.open("m", 0, "r", now=0.0)
    st.claim("m", v, "r", now=0.0, addrs=[0] * 4, done=[])
    st.heartbeat("r", [], now=3.0)
    st.expire(now=3.0)
    assert "pub" not in st.holders and st.status("m", v)["holders"] == []


def test_remove_retires_everything_and_ls_shows_it():
    st, v = setup()
    assert st.ls("m")[0]["latest"] == 1
    st.remove("m")
    assert st.expire(now=1.0) == [("m", v)] and st.ls() == []
    with pytest.raises(NotFound):
        st.remove("m")


def test_claim_without_lease_is_not_found():
    st, v = setup()
    with pytest.raises(NotFound):
        st.claim("m", v, "stranger", now=0.0, want=1)


def test_publish_after_rm_never_reuses_a_version_still_being_read():
    st, v1 = setup()
    st.open("m", v1, "reader", now=0.0)
    st.remove("m")
    assert st.publish(manifest(), "pub", [0] * 4, now=1.0) == 2
    assert st.objects["m"][1].readers  # the leased v1 is untouched


def test_heartbeat_of_a_reader_renews_its_lease_while_chunks_are_slow():
    st, v = setup(lease_ttl=5.0)
    st.open("m", 0, "r", now=0.0)
    st.claim("m", v, "r", now=0.0, addrs=[0] * 4, want=2)
    for t in (4.0, 8.0, 12.0):
        st.heartbeat("r", [], now=t, reading=[("m", v)])
        st.heartbeat("pub", [], now=t)
        st.expire(now=t)
    assert "r" in st.objects["m"][v].readers and st.holders["pub"].load == 2
