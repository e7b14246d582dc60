"""MasterState semantics, each as a test, on an explicit timeline (no clocks, no sockets)."""

import pytest

from kvplane.common.errors import InvalidArgument
from kvplane.store.errors import (
    InvalidKey,
    NoAvailableHandle,
    ObjectExists,
    ObjectHasLease,
    ObjectNotFound,
    ReplicaNotReady,
    SegmentExists,
    ValueTooLarge,
)
from kvplane.store.inventory import header_len
from kvplane.store.master.columns import Columns
from kvplane.store.master.config import MasterConfig
from kvplane.store.master.rows import ObjectsView
from kvplane.store.master.state import MasterState
from kvplane.store.types import ReplicateConfig, SegmentInfo

MB = 1 << 20
HDR = header_len("k")  # the inventory header in front of a one-letter key's value
FULL, HALF = MB - HDR, MB // 2 - HDR  # values that fill a 1 MB segment, and half of it


def state(n_segs=2, seg_size=MB, **cfg):
    st = MasterState(MasterConfig(**cfg), seed=1)
    for i in range(n_segs):
        st.mount(f"c{i}", [SegmentInfo(f"s{i}", 1_000_000 * (i + 1), seg_size, "", f"h:{i}", "host")], 0.0)
    return st


def put(st, key, size=1000, now=0.0, **cfg):
    r = st.put_start(key, size, ReplicateConfig(**cfg), now)
    if r.code == 0:
        assert st.put_end(key, now) == 0
    return r


def test_two_phase_put_is_invisible_until_end():
    st = state()
    r = st.put_start("k", 1000, ReplicateConfig(), 0.0)
    assert r.code == 0 and len(r.replicas) == 1 and r.replicas[0].size == 1000
    assert st.get_replicas("k", 0.0).code == ReplicaNotReady.code
    assert st.exist("k", 0.0) == 0
    st.put_end("k", 0.0)
    got = st.get_replicas("k", 0.0)
    assert got.code == 0 and got.replicas == r.replicas and st.exist("k", 0.0) == 1


def test_put_existing_is_refused_upsert_overwrites():
    st = state()
    put(st, "k")
    assert st.put_start("k", 2000, ReplicateConfig(), 1.0).code == ObjectExists.code
    assert st.get_replicas("k", 1.0).size == 1000
    up = st.put_start("k", 2000, ReplicateConfig(), 20.0, upsert=True)
    assert up.code == 0
    st.put_end("k", 20.0)
    assert st.get_replicas("k", 20.0).size == 2000


def test_revoke_frees_space_once_the_segment_fenced_it():
    st = state(n_segs=1)
    r = st.put_start("k", FULL, ReplicateConfig(), 0.0)
    assert st.used_ratio() == 1.0
    assert st.put_revoke("k", 0.0) == 0
    assert "k" not in st.objects
    assert st.put_revoke("k", 0.0) == ObjectNotFound.code
    st.reclaim(1.0)
    assert st.used_ratio() == 1.0  # a WRITE of the revoked put may still be queued at s0
    assert st.fences_for("c0") == [r.version]
    st.ping("c0", 1.0, fenced=[r.version])
    st.reclaim(1.0)
    assert st.used_ratio() == 0.0 and st.fences_for("c0") == []


def test_replicas_on_distinct_segments_best_effort():
    st = state(n_segs=3)
    r = put(st, "k", replica_num=2)
    assert len({x.segment for x in r.replicas}) == 2
    r = put(st, "k2", replica_num=5)
    assert len(r.replicas) == 3  # best effort: as many as there are segments


def test_preferred_segment_first():
    st = state(n_segs=3)
    for i in range(10):
        assert put(st, f"k{i}", preferred_segment="s2").replicas[0].segment == "s2"
    assert put(st, "p", preferred_segments=["nope", "s1"]).replicas[0].segment == "s1"


def test_free_ratio_first_fills_the_emptiest():
    st = state(n_segs=2, allocation_strategy="free_ratio_first")
    put(st, "big", size=MB // 2, preferred_segment="s0")
    assert all(put(st, f"k{i}", size=1000).replicas[0].segment == "s1" for i in range(5))


def test_lease_blocks_remove_until_it_ends():
    st = state(lease_ttl=10.0)
    put(st, "k")
    st.get_replicas("k", 5.0)
    assert st.remove("k", False, 6.0) == ObjectHasLease.code
    assert st.remove("k", False, 15.5) == 0
    assert st.remove("k", False, 15.5) == ObjectNotFound.code


def test_force_remove_of_leased_object_defers_its_space():
    st = state(n_segs=1, lease_ttl=10.0)
    put(st, "k", size=FULL)
    st.get_replicas("k", 1.0)
    assert st.remove("k", True, 2.0) == 0
    assert st.graveyard and st.used_ratio() == 1.0  # held for the reader...
    st.reclaim(11.5)  # ...until its lease is over
    assert not st.graveyard and st.used_ratio() == 0.0


def test_force_removed_space_is_reused_early_only_when_the_pool_is_full_and_it_is_fenced():
    """Readers holding the lease may read the place without asking the master (held reads):
    before the lease ends, the space goes to another object only once its segment refuses the
    old generation, and the caller is told to retire it at once."""
    st = state(n_segs=1, lease_ttl=10.0)
    gen = put(st, "k", size=HALF).replicas[0].gen
    st.get_replicas("k", 1.0)
    st.retiring.clear()
    assert st.remove("k", True, 2.0) == 0
    assert st.retiring == [("s0", gen, 11.0)]
    assert st.fences_for("c0") == [gen]  # sent with the owner's heartbeats until acknowledged
    assert st.put_start("a", HALF, ReplicateConfig(), 3.0).code == 0  # free space first
    assert len(st.graveyard) == 1
    assert st.put_start("b", HALF, ReplicateConfig(), 3.0).code == NoAvailableHandle.code
    assert st.ping("c0", 3.5, fenced=[gen]) == "ok"  # the segment refuses the generation now
    assert st.put_start("b", HALF, ReplicateConfig(), 4.0).code == 0  # pool full: graveyard
    assert not st.graveyard and st.fences_for("c0") == []


def test_space_a_client_retired_may_go_early_when_the_pool_is_full():
    """The remover had the segment refuse the old generation (``Retire``) and says so with
    its next PutStart: the space need not wait for the owner's heartbeat."""
    st = state(n_segs=1, lease_ttl=10.0)
    gen = put(st, "k", size=HALF).replicas[0].gen
    st.get_replicas("k", 1.0)
    assert st.remove("k", True, 2.0) == 0
    assert st.put_start("a", HALF, ReplicateConfig(), 3.0).code == 0
    assert st.retired([("s0", gen + 1), ("other", gen)]) == 0  # not what is held
    assert st.put_start("b", HALF, ReplicateConfig(), 3.0).code == NoAvailableHandle.code
    assert st.retired([("s0", gen)]) == 1
    assert st.put_start("b", HALF, ReplicateConfig(), 3.0).code == 0


def test_space_held_for_readers_frees_at_lease_end_without_its_fence():
    st = state(n_segs=1, lease_ttl=10.0)
    put(st, "k", size=FULL)
    st.get_replicas("k", 1.0)
    assert st.remove("k", True, 2.0) == 0
    st.reclaim(11.5)  # no reader holds the lease any more: the fence is moot
    assert not st.graveyard and st.used_ratio() == 0.0 and st.fences_for("c0") == []


def test_eviction_from_high_watermark_skips_leased_pinned_and_unfinished():
    st = state(n_segs=1, seg_size=100 * 1024, high_watermark=0.5, evict_ratio=0.2, lease_ttl=10.0)
    for i in range(8):
        put(st, f"k{i}", size=1024 * 8 - 64, now=float(i))
    put(st, "hard", size=1024 * 4, now=8.0, with_hard_pin=True)
    st.put_start("pending", 4096, ReplicateConfig(), 8.0)
    st.get_replicas("k0", 9.0)  # leased oldest
    assert st.used_ratio() > 0.5
    n = st.evict(9.5)
    assert n > 0
    assert {"k0", "hard", "pending"} <= set(st.objects)
    assert "k1" not in st.objects  # the oldest evictable went first
    assert st.used_ratio() <= 0.5


def test_soft_pinned_evicted_last():
    st = state(n_segs=1, seg_size=64 * 1024, high_watermark=0.99)
    put(st, "soft", size=16 * 1024, now=0.0, with_soft_pin=True)
    put(st, "plain", size=16 * 1024, now=1.0)
    assert st.evict(2.0, need=16 * 1024) == 1
    assert "soft" in st.objects and "plain" not in st.objects
    assert st.evict(3.0, need=16 * 1024) == 1  # nothing else left: the soft pin goes too
    assert "soft" not in st.objects


def test_allocation_failure_evicts_then_retries():
    st = state(n_segs=1, seg_size=64 * 1024)
    for i in range(4):
        put(st, f"k{i}", size=16 * 1024, now=float(i))
    r = st.put_start("new", 16 * 1024, ReplicateConfig(), 10.0)
    assert r.code == 0 and "k0" not in st.objects


def test_no_space_when_everything_is_protected():
    st = state(n_segs=1, seg_size=64 * 1024)
    put(st, "a", size=60 * 1024, with_hard_pin=True)
    r = st.put_start("b", 16 * 1024, ReplicateConfig(), 1.0)
    assert r.code == NoAvailableHandle.code


def test_abandoned_put_is_preempted_then_reclaimed():
    st = state(put_discard_timeout=30.0, put_release_timeout=600.0)
    st.put_start("k", 1000, ReplicateConfig(), 0.0)
    assert st.put_start("k", 1000, ReplicateConfig(), 10.0).code == ObjectExists.code
    assert st.put_start("k", 1000, ReplicateConfig(), 31.0).code == 0  # pre-empted
    st.put_start("z", 1000, ReplicateConfig(), 100.0)
    assert st.reclaim(701.0) >= 1 and "z" not in st.objects


def test_client_expiry_unmounts_and_drops_replicas():
    st = state(n_segs=2, client_ttl=10.0)
    r = put(st, "k", replica_num=2)
    assert len(r.replicas) == 2
    st.ping("c0", 5.0)
    assert st.expire_clients(12.0) == ["c1"]
    assert "s1" not in st.segments
    assert [x.segment for x in st.get_replicas("k", 12.0).replicas] == ["s0"]
    assert st.ping("c1", 12.0) == "need_remount"
    assert st.expire_clients(30.0) == ["c0"]
    assert "k" not in st.objects  # its last replica went with the last segment


def test_segment_names_belong_to_one_client():
    st = state(n_segs=1)
    with pytest.raises(SegmentExists):
        st.mount("other", [SegmentInfo("s0", 1, MB, "", "e", "h")], 0.0)
    st.mount("c0", [SegmentInfo("s0", 1, MB, "", "e", "h")], 0.0)  # remount by the owner: fine


def test_remove_regex_and_all():
    st = state()
    for k in ("a1", "a2", "b1"):
        put(st, k)
    st.get_replicas("a2", 0.0)
    assert st.remove_regex("^a", False, 1.0) == 1  # a2 is leased
    assert st.remove_all(False, 1.0) == 1  # b1
    assert st.remove_all(True, 1.0) == 1  # a2 by force
    with pytest.raises(InvalidArgument):
        st.remove_regex("(", False, 1.0)


def test_bad_keys_and_sizes():
    st = state()
    assert st.put_start("", 10, ReplicateConfig(), 0.0).code == InvalidKey.code
    assert st.put_start("x" * 5000, 10, ReplicateConfig(), 0.0).code == InvalidKey.code
    assert st.put_start("k", 0, ReplicateConfig(), 0.0).code < 0
    assert st.put_start("k", 10, ReplicateConfig(replica_num=0), 0.0).code < 0
    # never fits: not retried
    assert st.put_start("k", 10 * MB, ReplicateConfig(), 0.0).code == ValueTooLarge.code


def test_space_held_for_readers_does_not_evict_live_objects():
    st = state(n_segs=1, seg_size=100 * 1024, high_watermark=0.5, lease_ttl=10.0)
    for i in range(4):
        put(st, f"old{i}", size=20 * 1024 - 64, now=0.0)
    st.get_replicas("old0", 1.0)
    st.get_replicas("old1", 1.0)
    st.remove_all(True, 2.0)  # two leased ones go to the graveyard (40 % of the pool)
    put(st, "live", size=20 * 1024 - 64, now=3.0)
    assert st.used_ratio() > 0.5  # over the watermark counting held space
    assert st.evict(3.5) == 0 and "live" in st.objects  # only 20 % is live: nothing to evict


def test_batched_lookup_is_the_single_lookup_of_each_key():
    """get_replicas_many inlines the one-replica case: it must answer, lease and reorder the
    LRU exactly as get_replicas does key by key, for every kind of key."""
    def build():
        st = state(n_segs=3)
        put(st, "one", 1000)
        put(st, "two", 2000, replica_num=2)
        st.put_start("open", 500, ReplicateConfig(), 0.0)  # not finished
        put(st, "old", 700)
        return st

    keys = ["two", "missing", "one", "open", "one", "old"]
    a, b = build(), build()
    many = a.get_replicas_many(keys, 5.0)
    single = [b.get_replicas(k, 5.0) for k in keys]
    assert many == single
    assert [r.code for r in many] == [0, ObjectNotFound.code, 0, ReplicaNotReady.code, 0, 0]
    assert many[0].replicas[0].segment != many[0].replicas[1].segment
    assert list(a.objects) == list(b.objects)  # the same LRU order
    assert {k: o.lease_until for k, o in a.objects.items()} == \
        {k: o.lease_until for k, o in b.objects.items()}
    assert a.objects["one"].lease_until == 5.0 + a.config.lease_ttl


def _walked(*args, **kwargs):
    """Stands in for every walk of the whole object table (the timer must not walk it)."""
    raise AssertionError("walked every object")


def test_reclaim_drops_only_abandoned_puts_and_never_walks_every_object(monkeypatch):
    st = state(n_segs=2, seg_size=64 * MB, put_release_timeout=600.0)
    for i in range(200):
        put(st, f"done-{i}", 1000, now=0.0)
    st.put_start("ended", 1000, ReplicateConfig(), 0.0)
    st.put_end("ended", 1.0)
    st.put_start("revoked", 1000, ReplicateConfig(), 0.0)
    st.put_revoke("revoked", 1.0)
    st.put_start("old", 1000, ReplicateConfig(), 0.0)
    st.put_start("young", 1000, ReplicateConfig(), 500.0)
    for cls, name in ((Columns, "rows"), (Columns, "rows_newest"), (ObjectsView, "__iter__")):
        monkeypatch.setattr(cls, name, _walked)
    st.reclaim(700.0)
    assert "old" not in st.objects  # abandoned past the release timeout: dropped
    assert st.objects["young"].complete is False  # still inside it: kept
    assert st.objects["ended"].complete and st.objects.get("done-7") is not None
    assert set(st.open_puts) == {"young"}
    st.reclaim(1200.0)
    assert "young" not in st.objects and not st.open_puts


def _at(r):
    """A key's first replica as the location a client read it from."""
    rp = r.replicas[0]
    return (rp.segment, rp.addr, rp.gen, r.size)


def test_a_lookup_with_expected_locations_answers_only_the_keys_that_moved():
    """confirm_many: a key whose object still has a replica at the location the client read
    gets the lease and LRU move of a lookup and no answer; a key that is anywhere else (other
    generation, segment, address, size, gone, unfinished, unknown) gets get_replicas' answer."""
    def build():
        st = state(n_segs=3)
        for k in ("same", "two", "upserted", "removed", "sized", "elsewhere"):
            put(st, k, 1000, replica_num=2 if k == "two" else 1)
        return st

    a, b = build(), build()
    seen = {k: a.get_replicas(k, 1.0) for k in list(a.objects)}
    b.get_replicas_many(list(a.objects), 1.0)  # the same leases and LRU moves as a's lookups
    for st in (a, b):
        st.put_start("upserted", 1000, ReplicateConfig(), 2.0, upsert=True)  # a new allocation
        st.put_end("upserted", 2.0)
        st.remove("removed", True, 2.0)
        st.put_start("open", 500, ReplicateConfig(), 2.0)
    seg, addr, gen, size = _at(seen["elsewhere"])
    other = next(s for s in a.segments if s != seg)
    expect = [_at(seen["same"]), (seg, addr, gen, size), _at(seen["upserted"]),
              _at(seen["removed"]), _at(seen["sized"])[:3] + (999,),
              (other, addr, gen, size), (seg, addr + 64, gen, size), None, _at(seen["same"]),
              (seen["two"].replicas[1].segment, seen["two"].replicas[1].addr,
               seen["two"].replicas[1].gen, 1000)]
    keys = ["same", "elsewhere", "upserted", "removed", "sized", "elsewhere", "elsewhere", "sized",
            "open", "two"]
    stale, out = a.confirm_many(keys, expect, 5.0)
    single = [b.get_replicas(k, 5.0) for k in keys]  # key by key, with leases and LRU moves
    assert stale == [2, 3, 4, 5, 6, 7, 8]
    assert out == [single[i] for i in stale]
    assert [r.code for r in out] == [0, ObjectNotFound.code, 0, 0, 0, 0, ReplicaNotReady.code]
    assert list(a.objects) == list(b.objects)
    assert {k: o.lease_until for k, o in a.objects.items()} == \
        {k: o.lease_until for k, o in b.objects.items()}
    assert a.remove("same", False, 6.0) == ObjectHasLease.code  # the confirmation leased it


def test_a_location_reused_by_a_later_put_is_not_confirmed():
    """The same segment, address and size, taken again by a new put of the key once the old
    allocation was freed: only the generation tells the two apart."""
    st = state(n_segs=1)
    old = put(st, "k", 1000, now=2.0)
    assert st.remove("k", False, 100.0) == 0  # no lease: the space is free again at once
    new = put(st, "k", 1000, now=100.0)
    then = (old.replicas[0].segment, old.replicas[0].addr, old.replicas[0].gen, 1000)
    assert then[:2] == (new.replicas[0].segment, new.replicas[0].addr)  # the same place
    stale, out = st.confirm_many(["k", "k"], [then, then[:2] + (new.replicas[0].gen, 1000)], 101.0)
    assert stale == [0] and out[0].replicas[0].gen == new.replicas[0].gen


def test_a_lookup_in_columns_is_the_lookup_of_each_key_when_every_key_is_plain():
    """columns_many: the same leases, LRU moves and places as get_replicas_many, a list per
    field; None (and nothing different from get_replicas_many after it) when any key is a
    miss, unfinished, has two replicas or a copy on disk."""
    def build():
        st = state(n_segs=3)
        for i in range(6):
            put(st, f"k{i}", 1000 + i)
        put(st, "two", 500, replica_num=2)
        st.put_start("open", 500, ReplicateConfig(), 0.0)
        return st

    keys = ["k3", "k0", "k5", "k1", "k0"]
    a, b = build(), build()
    cols = a.columns_many(keys, 5.0)
    many = b.get_replicas_many(keys, 5.0)
    got = [(cols.segments[s], ad, n, g) for s, ad, n, g in zip(cols.seg, cols.addr, cols.size, cols.gen)]
    assert got == [(r.replicas[0].segment, r.replicas[0].addr, r.size, r.replicas[0].gen) for r in many]
    assert len(set(cols.segments)) == len(cols.segments) and len(cols.segments) > 1
    assert list(a.objects) == list(b.objects)
    assert {k: o.lease_until for k, o in a.objects.items()} == \
        {k: o.lease_until for k, o in b.objects.items()}
    for odd in ("missing", "open", "two", "k4"):
        a, b = build(), build()
        for st in (a, b):
            st.objects["k4"].disk = {"s9": "/ssd/k4"}  # a copy on disk too
        assert a.columns_many(["k1", odd, "k2"], 5.0) is None
        a.get_replicas_many(["k1", odd, "k2"], 5.0)
        b.get_replicas_many(["k1", odd, "k2"], 5.0)
        assert list(a.objects) == list(b.objects)
        assert {k: o.lease_until for k, o in a.objects.items()} == \
            {k: o.lease_until for k, o in b.objects.items()}
