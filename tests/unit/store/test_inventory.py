"""The segments' inventory (issue 10): record headers, the scan, and adoption by a master that
does not know the objects (a new leader, a restarted master)."""

import numpy as np

from kvplane.store import inventory
from kvplane.store.checksum import digest
from kvplane.store.master.adopt import EpochOrder
from kvplane.store.master.config import MasterConfig
from kvplane.store.master.state import MasterState
from kvplane.store.types import ReplicateConfig, SegmentInfo
from kvplane.transfer.fence import EPOCH_SHIFT, epoch_of

SECRET = inventory.secret_of("tok")
MB = 1 << 20


def write(mem, off, key, value, gen, version=None, secret=SECRET, want=1):
    head = inventory.pack(secret, key, gen, version or gen, len(value), digest(value), want)
    mem[off:off + len(head)] = np.frombuffer(head, np.uint8)
    mem[off + len(head):off + len(head) + len(value)] = np.frombuffer(value, np.uint8)
    return off + len(head) + len(value)


def gen(epoch, n):
    return epoch << EPOCH_SHIFT | n


def test_scan_finds_every_intact_record_with_its_exact_place():
    mem = np.zeros(MB, np.uint8)
    write(mem, 0, "a", b"x" * 1000, gen(5, 1))
    write(mem, 4096, "b/é", b"y" * 3000, gen(5, 2), want=2)
    found = inventory.scan(mem, SECRET, [5])
    assert [(r.key, r.offset, r.size, r.want) for r in found.records] == \
        [("a", 0, 1000, 1), ("b/é", 4096, 3000, 2)]
    assert found.records[0].hdr == inventory.header_len("a") and found.stale == []


def test_a_record_whose_value_changed_or_whose_tag_is_forged_is_not_trusted():
    mem = np.zeros(MB, np.uint8)
    write(mem, 0, "a", b"x" * 1000, gen(5, 1))
    mem[inventory.header_len("a") + 10] ^= 1  # one bit of the value flipped
    write(mem, 8192, "other-tenant/k", b"z" * 100, gen(5, 2), secret=b"guessed")
    found = inventory.scan(mem, SECRET, [5])
    assert found.records == [] and sorted(found.stale) == [0, 8192]


def test_overlapping_records_keep_the_newest_by_the_segments_mount_history():
    mem = np.zeros(MB, np.uint8)
    # epoch 3's object "new" lies inside the value of epoch 9's "old", and both verify (the
    # old value happens to hold the new record's bytes): only the mount history can decide
    write(mem, 4096, "new", b"n" * 2000, gen(3, 1))
    hdr = inventory.header_len("old")
    value = bytes(mem[hdr:hdr + 8000])
    write(mem, 0, "old", value, gen(9, 1))
    assert len(inventory.scan(mem, SECRET, []).records) == 1  # one of the two, never both
    found = inventory.scan(mem, SECRET, [9, 3])  # 9 mounted first, then 3: 3 is newer
    assert [r.key for r in found.records] == ["new"] and found.stale == [0]
    found = inventory.scan(mem, SECRET, [3, 9])
    assert [r.key for r in found.records] == ["old"] and found.stale == [4096]


def test_invalidate_only_clears_the_generation_it_names_and_restamp_rewrites_it():
    mem = np.zeros(MB, np.uint8)
    write(mem, 0, "a", b"x" * 100, gen(5, 1))
    assert not inventory.invalidate(mem, 0, gen(5, 2))  # reused since: not that one
    inventory.restamp(mem, 0, gen(6, 7))
    assert inventory.scan(mem, SECRET, [5, 6]).records[0].gen == gen(6, 7)
    assert inventory.invalidate(mem, 0, gen(6, 7))
    assert inventory.scan(mem, SECRET, [5, 6]).records == []


def test_epoch_order_follows_mount_histories_not_numbers():
    order = EpochOrder(current=2)
    order.add([40, 7])
    order.add([7, 11])
    assert order.newer(gen(11, 1), gen(7, 9)) and order.newer(gen(7, 1), gen(40, 9))
    assert order.newer(gen(2, 1), gen(11, 5))  # this master's own epoch is the newest


def state(epoch=21):
    st = MasterState(MasterConfig(), seed=1, epoch=epoch)
    st.secret = SECRET
    return st


def mount(st, name, adopt=True):
    st.mount(f"c-{name}", [SegmentInfo(name, 10 * MB, MB, "", f"{name}:1", "h")], 0.0, adopt=adopt)


def records(mem, history):
    return inventory.scan(mem, SECRET, history).records


def test_a_new_master_adopts_records_at_their_exact_offsets_and_serves_them():
    old = state(epoch=5)
    mount(old, "s1", adopt=False)
    mem = np.zeros(MB, np.uint8)
    put = old.put_start("k", 3000, ReplicateConfig(), 0.0, checksum=digest(b"v" * 3000))
    assert old.put_end("k", 0.1, put.version) == 0
    off = put.replicas[0].addr - 10 * MB - inventory.header_len("k")
    write(mem, off, "k", b"v" * 3000, put.version)

    new = state()
    mount(new, "s1")
    assert new.put_start("x", 10, ReplicateConfig(), 1.0).code != 0  # still re-registering
    gens = new.adopt("c-s1", "s1", records(mem, [5, 21]), [5, 21], True, 1.0)
    assert epoch_of(gens[0]) == 21
    got = new.get_replicas("k", 1.0)
    assert got.code == 0 and got.version == put.version and got.size == 3000
    assert got.replicas[0].addr == put.replicas[0].addr and got.replicas[0].gen == gens[0]
    # the space is taken: a new put never lands on it
    later = new.put_start("y", MB // 2, ReplicateConfig(), 2.0)
    start = later.replicas[0].addr - 10 * MB - inventory.header_len("y")
    assert later.code == 0 and start >= off + inventory.header_len("k") + 3000


def test_replicas_join_up_to_the_count_asked_and_stale_versions_are_refused():
    st = state()
    mem1, mem2, mem3 = (np.zeros(MB, np.uint8) for _ in range(3))
    v1, v2 = gen(5, 1), gen(5, 2)
    for mem in (mem1, mem2, mem3):
        write(mem, 0, "k", b"a" * 100, v1, want=2)
    write(mem3, 0, "k", b"b" * 100, v2, want=2)  # s3 holds a newer put of k
    for name in ("s1", "s2", "s3"):
        mount(st, name)
    assert st.adopt("c-s1", "s1", records(mem1, [5]), [5], True, 0.0)[0]
    assert st.adopt("c-s2", "s2", records(mem2, [5]), [5], True, 0.0)[0]
    assert len(st.objects["k"].replicas) == 2
    assert st.adopt("c-s3", "s3", records(mem3, [5]), [5], True, 0.0)[0]  # newer: replaces
    obj = st.objects["k"]
    assert obj.version == v2 and [r[0] for r in obj.replicas] == ["s3"]
    assert "k" in st.repairs.short  # one of two: re-replication brings the second back


def test_a_repeated_adopt_call_is_answered_the_same():
    st = state()
    mem = np.zeros(MB, np.uint8)
    write(mem, 0, "k", b"a" * 100, gen(5, 1))
    mount(st, "s1")
    recs = records(mem, [5])
    first = st.adopt("c-s1", "s1", recs, [5], False, 0.0)
    assert st.adopt("c-s1", "s1", recs, [5], True, 0.0) == first


def test_a_removed_object_is_forgotten_by_its_segment():
    st = state()
    mount(st, "s1", adopt=False)
    put = st.put_start("k", 100, ReplicateConfig(), 0.0)
    st.put_end("k", 0.0, put.version)
    assert st.remove("k", True, 1.0) == 0
    forgets = st.forgets_for("c-s1")
    assert forgets == [(put.version, put.replicas[0].addr - inventory.header_len("k"))]
    st.ping("c-s1", 2.0, forgot=[put.version])
    assert st.forgets_for("c-s1") == []


def test_recovering_answers_misses_until_the_expected_segments_are_back():
    st = state()
    st.recover(0.0, 3.0, {"s1"})
    assert st.recovering(1.0)
    mount(st, "s1")
    st.adopt("c-s1", "s1", [], [], True, 1.0)
    assert not st.recovering(1.0)
    st.recover(5.0, 3.0, None)  # nothing known to wait for: the grace alone
    assert st.recovering(7.0) and not st.recovering(8.5)


def test_a_segment_back_after_its_ttl_does_not_bring_back_what_was_removed_meanwhile():
    st = state()
    for name in ("s1", "s2"):
        mount(st, name, adopt=False)
    mems = {"s1": np.zeros(MB, np.uint8), "s2": np.zeros(MB, np.uint8)}
    puts = {}
    for key in ("kept", "removed"):
        r = st.put_start(key, 100, ReplicateConfig(replica_num=2), 0.0)
        st.put_end(key, 0.0, r.version)
        puts[key] = r
        for rep in r.replicas:
            off = rep.addr - 10 * MB - inventory.header_len(key)
            write(mems[rep.segment], off, key, b"q" * 100, rep.gen, version=r.version, want=2)
    st.unmount("s1")  # its TTL ran out (a partition)
    assert st.remove("removed", True, 1.0) == 0
    mount(st, "s1")  # back, with the same master
    recs = records(mems["s1"], [21])
    gens = dict(zip((r.key for r in recs), st.adopt("c-s1", "s1", recs, [21], True, 2.0)))
    assert gens["removed"] == 0 and "removed" not in st.objects
    assert gens["kept"] and len(st.objects["kept"].replicas) == 2  # it rejoins
