"""MasterState integrity rules (issue 15), each on an explicit timeline: generations, the
quarantine of freed space, version-checked PutEnd, suspects, and re-replication tasks."""

from kvplane.store.errors import ObjectNotFound
from kvplane.store.inventory import header_len
from kvplane.store.master.config import MasterConfig
from kvplane.store.master.state import MasterState
from kvplane.store.types import ReplicateConfig, SegmentInfo
from kvplane.transfer.fence import epoch_of

MB = 1 << 20
HDR = header_len("k")  # the inventory header in front of a one-letter key's value
FULL, HALF = MB - HDR, MB // 2 - HDR  # values that fill a 1 MB segment, and half of it


def state(n_segs=2, seg_size=MB, epoch=7, **cfg):
    st = MasterState(MasterConfig(**cfg), seed=1, epoch=epoch)
    for i in range(n_segs):
        st.mount(f"c{i}", [SegmentInfo(f"s{i}", 1_000_000 * (i + 1), seg_size, "", f"h:{i}", "host")], 0.0)
    return st


def test_every_put_gets_a_fresh_generation_of_this_masters_epoch():
    st = state()
    a = st.put_start("a", 1000, ReplicateConfig(replica_num=2), 0.0)
    b = st.put_start("b", 1000, ReplicateConfig(), 0.0)
    assert epoch_of(a.version) == epoch_of(b.version) == 7
    assert a.version != b.version
    assert {r.gen for r in a.replicas} == {a.version}  # the frames carry it


def test_put_end_of_a_pre_empted_put_is_refused_and_the_new_writer_keeps_the_key():
    st = state(n_segs=1, put_discard_timeout=30.0)
    old = st.put_start("k", 1000, ReplicateConfig(), 0.0, client_id="slow", window=5.0)
    new = st.put_start("k", 1000, ReplicateConfig(), 31.0, client_id="fast")
    assert new.code == 0 and new.version != old.version
    assert st.put_end("k", 31.5, old.version) == ObjectNotFound.code  # not committed
    assert st.get_replicas("k", 31.5).code != 0  # still the new, unwritten put
    assert st.put_end("k", 32.0, new.version, checksum=99) == 0
    assert st.get_replicas("k", 32.0).checksum == 99


def test_revoke_of_someone_elses_version_changes_nothing():
    st = state(n_segs=1)
    r = st.put_start("k", 1000, ReplicateConfig(), 0.0)
    assert st.put_revoke("k", 0.0, r.version + 1) == ObjectNotFound.code
    assert "k" in st.objects


def test_space_of_an_unfinished_put_waits_for_its_window_and_its_segment_fence():
    st = state(n_segs=1, seg_size=MB, put_discard_timeout=30.0)
    r = st.put_start("k", FULL, ReplicateConfig(), 0.0, window=8.0)
    assert st.remove("k", True, 1.0) == 0  # force-removed while its writer may still copy
    st.ping("c0", 2.0, fenced=[r.version])  # the segment fenced it early...
    st.reclaim(2.0)
    assert st.put_start("x", FULL, ReplicateConfig(), 2.0).code != 0  # ...but the window is open
    st.reclaim(8.5)
    assert st.put_start("x", FULL, ReplicateConfig(), 8.5).code == 0


def test_unacknowledged_fences_are_resent_and_block_reuse():
    st = state(n_segs=1)
    r = st.put_start("k", FULL, ReplicateConfig(), 0.0)
    st.put_revoke("k", 0.0, r.version)
    for t in (1.0, 2.0, 3.0):  # the segment pings without acknowledging (a WRITE in progress)
        st.ping("c0", t)
        assert st.fences_for("c0") == [r.version]
        st.reclaim(t)
        assert st.used_ratio() == 1.0
    st.ping("c0", 4.0, fenced=[r.version])
    st.reclaim(4.0)
    assert st.used_ratio() == 0.0


def test_a_suspected_segment_gets_no_placement_and_is_read_last_until_it_heartbeats():
    st = state(n_segs=2, suspect_min=1.0)
    r = st.put_start("k", 1000, ReplicateConfig(replica_num=2), 0.0)
    st.put_end("k", 0.0, r.version)
    first = st.get_replicas("k", 0.0).replicas[0].segment
    st.suspect([first], 1.0)
    assert st.get_replicas("k", 1.0).replicas[-1].segment == first
    for i in range(10):
        got = st.put_start(f"p{i}", 1000, ReplicateConfig(replica_num=2), 1.0)
        assert [x.segment for x in got.replicas] != [] and first not in [x.segment for x in got.replicas]
    owner = st.segments[first].info.client_id
    st.ping(owner, 1.5)  # too soon: may have been sent before the failure
    assert st.segments[first].suspect_since is not None
    st.ping(owner, 2.5)
    assert st.segments[first].suspect_since is None


def test_lost_replicas_are_re_created_by_the_target_segments_owner():
    st = state(n_segs=3, client_ttl=10.0)
    r = st.put_start("k", 1000, ReplicateConfig(replica_num=2), 0.0)
    st.put_end("k", 0.0, r.version, checksum=5)
    gone = r.replicas[0].segment
    for c in ("c0", "c1", "c2"):
        if st.segments[f"s{c[1]}"].info.name != gone:
            st.ping(c, 9.0)
    st.expire_clients(12.0)
    assert st.repairs.under_replicated() == 1
    assert st.repairs.plan(12.0) == 1
    target = next(n for n in st.segments if n not in {x.segment for x in st.get_replicas("k", 12.0).replicas})
    owner = st.segments[target].info.client_id
    (task,) = st.repairs.take(owner)
    assert task.key == "k" and task.checksum == 5 and task.version == r.version
    assert task.gen != r.version and task.sources[0].segment != gone
    assert st.repairs.take(owner) == []  # delivered once
    assert st.repairs.done("k", task.gen, True, 13.0)
    assert sorted(x.segment for x in st.get_replicas("k", 13.0).replicas) == \
        sorted({r.replicas[1].segment, target})
    assert st.repairs.under_replicated() == 0


def test_an_abandoned_repair_is_fenced_before_its_space_is_reused():
    st = state(n_segs=2, seg_size=4096, repair_timeout=30.0)
    r = st.put_start("k", 1000, ReplicateConfig(replica_num=2), 0.0)
    st.put_end("k", 0.0, r.version)
    st.unmount(r.replicas[0].segment)
    st.mount("c9", [SegmentInfo("s9", 9_000_000, 4096, "", "h:9", "host")], 0.0)
    st.repairs.plan(1.0)
    (task,) = st.repairs.take("c9")
    assert st.repairs.expire(31.5) == 1  # the owner never answered
    assert st.fences_for("c9") == [task.gen]
    used = st.segments["s9"].alloc.used
    st.reclaim(40.0)
    assert st.segments["s9"].alloc.used == used  # not before the fence
    st.ping("c9", 40.0, fenced=[task.gen])
    st.reclaim(40.0)
    assert st.segments["s9"].alloc.used == 0


def test_a_dead_writers_unfinished_puts_are_fenced_and_freed():
    st = state(n_segs=1, client_ttl=10.0)
    st.mount("w", [], 0.0)
    r = st.put_start("k", FULL, ReplicateConfig(), 0.0, client_id="w", window=5.0)
    st.ping("c0", 11.0)
    assert st.expire_clients(11.0) == ["w"]
    assert "k" not in st.objects and st.fences_for("c0") == [r.version]


def test_a_repair_that_completes_after_the_replica_came_back_is_dropped_and_freed():
    """Issue 28: a replica that comes back (re-registration) while its repair is in flight
    leaves the object with the replicas it asked for, not one more."""
    st = state(n_segs=3)
    r = st.put_start("k", 1000, ReplicateConfig(replica_num=2), 0.0)
    st.put_end("k", 0.0, r.version)
    obj = st.objects["k"]
    back = obj.replicas[1]
    obj.replicas = obj.replicas[:1]  # as if its second segment had not re-registered yet
    st.repairs.short.add("k")
    assert st.repairs.plan(1.0) == 1
    task = next(p.task for p in st.repairs.pending.values())
    target = st.repairs.pending["k"].segment
    used = st.segments[target].alloc.used
    obj.replicas += (back,)  # re-registered meanwhile
    assert not st.repairs.done("k", task.gen, True, 2.0)
    assert len(st.objects["k"].replicas) == 2 and st.repairs.surplus == 1
    assert st.segments[target].alloc.used < used  # the copy's space is free again
    assert st.repairs.under_replicated() == 0


def test_no_repair_is_planned_while_the_master_recovers_or_a_segment_re_registers():
    st = state(n_segs=3)
    r = st.put_start("k", 1000, ReplicateConfig(replica_num=2), 0.0)
    st.put_end("k", 0.0, r.version)
    obj = st.objects["k"]
    obj.replicas = obj.replicas[:1]
    st.repairs.short.add("k")
    st.recover(1.0, 3.0, None)  # a restart: misses wait for the grace
    assert st.repairs.plan(2.0) == 0
    st.segments["s2"].adopting = True  # past the grace, one segment still re-registering
    assert st.repairs.plan(5.0) == 0
    st.segments["s2"].adopting = False
    assert st.repairs.plan(5.0) == 1
