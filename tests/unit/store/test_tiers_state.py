"""The SSD tier on the master's state (``master/tiers.py``), on an explicit timeline."""

from kvplane.store import inventory
from kvplane.store.errors import NoAvailableHandle, ObjectNotFound
from kvplane.store.master.config import MasterConfig
from kvplane.store.master.state import MasterState
from kvplane.store.master.tiers import BUSY
from kvplane.store.types import ReplicateConfig, SegmentInfo

MB = 1 << 20
VAL = MB // 4 - inventory.header_len("k0")  # four objects fill a 1 MB segment


def state(disk=True, write_through=False, **cfg):
    st = MasterState(MasterConfig(**cfg), seed=1)
    info = SegmentInfo("s0", 1_000_000, MB, "", "h:0", "host", disk_size=64 * MB if disk else 0,
                       disk_endpoint="h:9", write_through=write_through)
    st.mount("c0", [info], 0.0)
    return st


def put(st, key, now=0.0, size=VAL):
    r = st.put_start(key, size, ReplicateConfig(), now)
    if r.code == 0:
        assert st.put_end(key, now) == 0
    return r.code


def offload_all(st, now=0.0):
    """The node copies every task it was handed and reports it."""
    st.tiers.plan(now)
    tasks = st.tiers.take({"s0"})
    for t in tasks:
        assert st.tiers.offload_done("s0", t.key, t.version, True, f"/d/{t.key}")
    return [t.key for t in tasks]


def test_without_a_disk_eviction_drops_objects_as_before():
    st = state(disk=False)
    for i in range(4):
        assert put(st, f"k{i}", now=i) == 0
    assert put(st, "k4", now=5) == 0
    assert "k0" not in st.objects and not st.tiers.offloads


def test_objects_near_eviction_are_offloaded_and_eviction_demotes_them():
    st = state()
    for i in range(4):
        assert put(st, f"k{i}", now=i) == 0
    assert offload_all(st, now=4) == ["k0"]  # the LRU tail, above the 0.80 offload watermark
    assert put(st, "k4", now=11) == 0  # evicts k0's memory replica: it stays, on disk
    obj = st.objects["k0"]
    assert obj.replicas == () and obj.disk == {"s0": "/d/k0"} and st.tiers.demoted == 1
    got = st.get_replicas("k0", 12)
    assert got.code == 0 and got.replicas == [] and [d.endpoint for d in got.disk] == ["h:9"]


def test_a_full_pool_of_objects_not_on_disk_yet_waits_instead_of_losing_them():
    st = state()
    for i in range(4):
        assert put(st, f"k{i}", now=i) == 0
    assert put(st, "k4", now=11) == NoAvailableHandle.code  # nothing could go: k0.. queued
    assert set(st.objects) == {"k0", "k1", "k2", "k3"} and st.tiers.offloads
    offload_all(st, now=12)
    assert put(st, "k4", now=12) == 0
    assert all(k in st.objects for k in ("k0", "k1", "k2", "k3", "k4"))


def test_a_failed_or_late_offload_makes_the_object_evictable_again():
    st = state()
    for i in range(4):
        assert put(st, f"k{i}", now=i) == 0
    st.tiers.plan(4)
    t = st.tiers.take({"s0"})[0]
    assert not st.tiers.offload_done("s0", t.key, t.version, False, "")
    st.tiers.plan(5)
    st.tiers.take({"s0"})
    st.tiers.expire(100.0)  # the rest never answered
    assert put(st, "k4", now=100) == 0 and "k0" not in st.objects


def test_write_through_offloads_every_committed_object():
    st = state(write_through=True)
    put(st, "a")
    put(st, "b")
    assert sorted(offload_all(st)) == ["a", "b"]
    assert all(st.objects[k].disk for k in ("a", "b"))


def test_an_offload_of_a_replaced_version_is_refused():
    st = state(write_through=True)
    put(st, "a")
    st.tiers.plan(0)
    t = st.tiers.take({"s0"})[0]
    st.remove("a", True, 1.0)
    put(st, "a", now=20)
    assert not st.tiers.offload_done("s0", "a", t.version, True, "/d/a")
    assert not st.objects["a"].disk


def test_promotion_gives_a_disk_only_object_a_memory_replica_again():
    st = state()
    for i in range(4):
        put(st, f"k{i}", now=i)
    offload_all(st, 4)
    put(st, "k4", now=11)
    v = st.objects["k0"].version
    assert st.tiers.promote_start("s0", "k0", v, 12).code == NoAvailableHandle.code
    offload_all(st, 12)  # the rest near eviction reached the disk: room can be made
    task = st.tiers.promote_start("s0", "k0", v, 12)
    assert task.code == 0 and st.tiers.promote_start("s0", "k0", v, 12).code == BUSY
    assert st.tiers.promote_end("k0", task.gen, True, 12)
    got = st.get_replicas("k0", 13)
    assert [r.gen for r in got.replicas] == [task.gen] and got.disk  # both tiers now
    assert st.tiers.promote_start("s0", "k0", v, 13).code == BUSY  # in memory already
    assert st.tiers.promote_start("s0", "k0", v + 1, 13).code == ObjectNotFound.code


def test_an_abandoned_promotion_is_fenced_before_its_space_is_reused():
    st = state(high_watermark=1.0)  # promotion may fill the segment (it never passes the mark)
    for i in range(4):
        put(st, f"k{i}", now=i)
    offload_all(st, 4)
    put(st, "k4", now=11)
    offload_all(st, 12)
    task = st.tiers.promote_start("s0", "k0", st.objects["k0"].version, 12)
    assert task.code == 0
    st.tiers.expire(12 + 11)
    assert task.gen in st.fences_for("c0") and not st.objects["k0"].replicas


def test_a_removed_object_has_its_disk_copy_deleted_by_its_owner():
    st = state(write_through=True)
    put(st, "a")
    offload_all(st)
    v = st.objects["a"].version
    assert st.remove("a", False, 20.0) == 0
    assert st.tiers.forgets_for({"s0"}) == [("a", v)]


def test_a_lost_disk_copy_of_a_disk_only_object_removes_it():
    st = state()
    for i in range(4):
        put(st, f"k{i}", now=i)
    offload_all(st, 4)
    put(st, "k4", now=11)
    assert st.tiers.lost("s0", "k0", st.objects["k0"].version, 12)
    assert st.get_replicas("k0", 12).code == ObjectNotFound.code


def test_disk_copies_are_readopted_after_a_master_restart_and_newer_versions_win():
    rec = lambda key, version: inventory.Record(0, inventory.header_len(key), key, version,  # noqa: E731
                                                version, 1000, 55)
    st = state()
    gens = st.tiers.adopt(st.segments["s0"], [rec("x", 5), rec("y", 6)], ["/d/x", "/d/y"], [], 0)
    assert gens == [1, 1]
    got = st.get_replicas("x", 1)
    assert got.code == 0 and got.replicas == [] and got.disk[0].path == "/d/x"
    put(st, "z")  # this master's own object is newer than any record of an older epoch
    assert st.tiers.adopt(st.segments["s0"], [rec("z", 1)], ["/d/z"], [], 1) == [0]


def test_an_unmounted_node_takes_its_disk_copies_with_it():
    st = state()
    for i in range(4):
        put(st, f"k{i}", now=i)
    offload_all(st, 4)
    put(st, "k4", now=11)
    lost = st.unmount("s0")
    assert lost == 5 and not st.objects


def test_planning_counts_replicas_already_on_disk_and_queues_nothing_more():
    st = state(write_through=True)
    for i in range(4):
        put(st, f"k{i}", now=i)
    assert len(offload_all(st, 4)) == 4  # memory full, everything on disk too
    assert st.tiers.plan(5) == 0 and not st.tiers.offloads
    assert put(st, "k4", now=11) == 0  # eviction demotes at once: nothing waits
    assert st.objects["k0"].replicas == () and list(st.objects)[-2:] == ["k0", "k4"]


def test_a_node_back_after_its_ttl_brings_back_what_it_took_not_what_was_removed():
    st = state(write_through=True)
    for key in ("gone", "kept", "lost"):
        put(st, key)
    offload_all(st)
    recs = [inventory.Record(0, o.hdr, k, o.version, o.version, o.size, o.checksum)
            for k, o in st.objects.items()]
    assert st.remove("gone", False, 20.0) == 0  # its forget never reaches the node ...
    assert st.unmount("s0") == 2  # ... whose TTL ran out: "kept" and "lost" left with it
    back = SegmentInfo("s1", 5_000_000, MB, "", "h:1", "host", disk_size=64 * MB)
    st.mount("c1", [back], 20.0)
    put(st, "kept", now=20)  # written again meanwhile: a newer version
    got = st.tiers.adopt(st.segments["s1"], recs, ["/d/gone", "/d/kept", "/d/lost"], [], 21)
    assert got == [0, 0, 1]
    assert "gone" not in st.objects and not st.objects["kept"].disk
    assert st.get_replicas("lost", 22).disk[0].path == "/d/lost"


def test_promotion_never_takes_a_segment_past_the_eviction_watermark():
    """Promoted copies are leased by their readers and eviction skips leased objects: memory
    full of them would lock puts out (issue 28)."""
    st = state(write_through=True)  # high watermark 0.9: three of four slots may be promoted
    for i in range(4):
        put(st, f"k{i}", now=i)
    offload_all(st, 4)
    for i in range(4):
        st.tiers.demote(f"k{i}", st.objects[f"k{i}"], 5)
    got = []
    for i in range(4):
        st.get_replicas(f"k{i}", 6)  # a reader's lease
        task = st.tiers.promote_start("s0", f"k{i}", st.objects[f"k{i}"].version, 6)
        if task.code == 0:
            assert st.tiers.promote_end(f"k{i}", task.gen, True, 6)
        got.append(task.code)
    assert got == [0, 0, 0, NoAvailableHandle.code] and st.tiers.refused == 1
    assert st.put_start("new", VAL, ReplicateConfig(), 7).code == 0  # room for a put


def test_a_put_that_finds_memory_full_of_leased_objects_is_told_when_the_first_lease_ends():
    st = state(lease_ttl=3.0)
    for i in range(4):
        put(st, f"k{i}", now=i)
        st.get_replicas(f"k{i}", 10 + i)  # leases end at 13..16
    assert st.put_start("new", VAL, ReplicateConfig(), 11).code == NoAvailableHandle.code
    assert st.lease_wait(11) == 2.0
    assert st.lease_wait(20) == 0.0  # none left: nothing to wait for
