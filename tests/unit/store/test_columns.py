"""The object table's storage (issue 32): the key index, rows, replica rows, the LRU list, and
the passes in steps (an unmount's sweep, an eviction pass)."""

import random

import pytest

from kvplane.common.errors import InvalidArgument
from kvplane.store.errors import ObjectNotFound
from kvplane.store.master import columns
from kvplane.store.master import keys as keymod
from kvplane.store.master.allocator import ALIGN, OffsetAllocator
from kvplane.store.master.columns import Columns
from kvplane.store.master.config import MasterConfig
from kvplane.store.master.keys import KeyIndex, KeyList
from kvplane.store.master.state import MasterState
from kvplane.store.types import ReplicateConfig, SegmentInfo
from kvplane.testing.needs import requires

MB = 1 << 20


@pytest.fixture(params=["native", "python"])
def table_path(request, monkeypatch):
    """Run a test on the C accelerator's index probe and LRU move, and again on Python's."""
    if request.param == "native":
        requires("store_accel")
    else:
        monkeypatch.setattr(keymod, "native", None)
    return request.param


def test_key_index_matches_a_dict_through_growth_and_removals(table_path):
    """Random adds and removals (with shards growing, and removals shifting entries back):
    every key is found at its row, every removed key is gone."""
    rng = random.Random(3)
    keys = KeyList()
    index = KeyIndex(keys)
    model: dict[str, int] = {}
    for step in range(60_000):
        if model and rng.random() < 0.4:
            key = rng.choice(list(model)) if step % 97 == 0 else next(iter(model))
            index.remove(key.encode())
            keys[model.pop(key)] = None
        else:
            key = f"key-{rng.randrange(1 << 40)}-é"  # stored as UTF-8 bytes, found by str
            if key in model:
                continue
            keys.append(key.encode())
            index.add(keys[len(keys) - 1], len(keys) - 1)
            model[key] = len(keys) - 1
    assert all(index.find(k) == r for k, r in model.items())
    assert all(index.find(k) == -1 for k in (f"key-{rng.randrange(1 << 40)}x" for _ in range(1000)))
    gone = [k for i in range(len(keys)) if (k := keys[i]) is not None and k.decode() not in model]
    assert not gone


def test_key_index_shards_grow_alone():
    """A shard doubles when two thirds full; the others keep their size (a growth rehashes
    about 1/SHARDS of the keys)."""
    keys = KeyList()
    index = KeyIndex(keys)
    for i in range(keymod.SHARDS * 8):
        keys.append(f"k{i}".encode())
        index.add(keys[i], i)
    sizes = [len(s) for s in index._shards]
    assert max(sizes) > min(sizes) and sum(sizes) < 8 * keymod.SHARDS * 8


def test_both_paths_give_the_same_table():
    """The same adds, drops, renames, LRU moves and lookups through the C accelerator and
    through the Python code leave the same rows, LRU order and index answers."""
    requires("store_accel")
    saved = keymod.native
    made = []
    for accel in (saved, None):
        keymod.native = accel
        try:
            c = Columns()
        finally:
            keymod.native = saved
        made.append(c)
    rng = random.Random(5)
    live: list[str] = []
    seen: list[list[int]] = [[], []]
    for step in range(30_000):
        op = rng.random()
        if live and op < 0.25:
            key = live.pop(rng.randrange(len(live)))
            for c in made:
                c.drop(c.index.find(key))
        elif live and op < 0.6:
            key = rng.choice(live)
            for side, c in enumerate(made):
                row = c.index.find(key)
                c.touch(row)
                seen[side].append(row)
        elif live and op < 0.61:  # the oldest (the head moves)
            for side, c in enumerate(made):
                seen[side].append(c.head)
                c.touch(c.head)
        elif live and op < 0.62:
            old = live.pop(rng.randrange(len(live)))
            key = f"r{step}-é"
            live.append(key)
            for c in made:
                c.rename(c.index.find(old), key)
        else:
            key = f"k{step}-{rng.randrange(1 << 30)}"
            live.append(key)
            for side, c in enumerate(made):
                seen[side].append(c.add(key))
        for side, c in enumerate(made):  # a miss, on every step
            seen[side].append(c.index.find(f"missing-{step}"))
    a, b = made
    assert seen[0] == seen[1]
    assert list(a.rows()) == list(b.rows()) and (a.head, a.tail) == (b.head, b.tail)
    assert list(a.rows_newest()) == list(a.rows())[::-1]
    assert [a.index.find(k) for k in live] == [b.index.find(k) for k in live]
    assert all(a.key(a.index.find(k)) == k for k in live)
    assert a.index._shards == b.index._shards


def test_the_accelerator_refuses_what_would_read_out_of_bounds():
    """Bad arguments raise; they never read past an array."""
    from array import array

    native = requires("store_accel")
    c = Columns()
    c.add("a")
    c.add("b")
    with pytest.raises(IndexError):
        native.touch(c.nxt, c.prv, c._ends, len(c.nxt))
    with pytest.raises(TypeError):
        native.touch(c.nxt, array("q", [0]), c._ends, 0)
    with pytest.raises(TypeError):
        native.find(c.index._shards, array("i", [0]), "a")
    with pytest.raises(ValueError):
        native.find(c.index._shards[:3], c.keys.addrs, "a")
    assert native.find(c.index._shards, c.keys.addrs, "b") == 1


def test_the_cyclic_collector_reaches_no_key():
    """No object the collector tracks refers to a stored key: a full collection does not
    walk millions of them (a list of keys costs 0.1-0.4 s per collection at 10M)."""
    import gc

    c = Columns()
    for i in range(70_000):  # past one chunk of the key list
        c.add(f"k{i}")
    assert len(c.keys.chunks) == 2 and c.keys[69_999] == b"k69999"
    for row in (0, 65_536, 69_999):
        assert gc.get_referrers(c.keys[row]) == []


def test_rows_are_reused_and_the_lru_list_stays_whole(table_path):
    c = Columns()
    rows = [c.add(f"k{i}") for i in range(10)]
    assert rows == list(range(10)) and list(c.rows()) == rows
    c.touch(3)
    c.touch(0)
    c.drop(5)
    assert list(c.rows()) == [1, 2, 4, 6, 7, 8, 9, 3, 0]
    assert list(c.rows_newest()) == [0, 3, 9, 8, 7, 6, 4, 2, 1]
    assert c.add("new") == 5 and c.key(5) == "new" and c.tail == 5  # the freed row, newest
    assert c.count == 10 and c.index.find("k5") == -1 and c.index.find("new") == 5


def test_replica_rows_chain_and_skip_segments_that_went():
    c = Columns()
    a, b, d = c.new_sid("a"), c.new_sid("b"), c.new_sid("d")
    row = c.add("k")
    c.set_replicas(row, [(a, 0, 7), (b, 64, 8), (d, 128, 9)])
    assert c.replicas(row) == [(a, 0, 7), (b, 64, 8), (d, 128, 9)]
    c.retire_sid("b")
    assert c.replicas(row) == [(a, 0, 7), (d, 128, 9)]  # readers skip it at once
    found, _ = c.rows_on(b, 0, c.scan_end())
    assert found == [row]  # the sweep still finds it
    c.set_replicas(row, [(a, 0, 7)])
    assert c.rows_on(b, 0, c.scan_end())[0] == []  # its replica rows were freed
    c.release_sid(b)
    assert c.new_sid("e") == b  # a released id is given again


def test_a_free_of_the_wrong_size_or_twice_is_refused():
    a = OffsetAllocator(16 * ALIGN)
    x = a.allocate(2 * ALIGN)
    y = a.allocate(ALIGN)
    a.free(y, ALIGN)
    with pytest.raises(InvalidArgument):
        a.free(x, 3 * ALIGN)  # runs into the free block at y
    with pytest.raises(InvalidArgument):
        a.free(y, ALIGN)  # freed already
    a.free(x, 2 * ALIGN)
    assert a.used == 0 and a.fragments() == 1


def _state(n, segs=("s0", "s1"), replica_num=1):
    st = MasterState(MasterConfig(), seed=1)
    st.mount("c0", [SegmentInfo(s, i * 1024 * MB, 64 * MB, "", f"h:{i}", "host")
                    for i, s in enumerate(segs)], 0.0)
    for i in range(n):
        r = st.put_start(f"k{i}", 1000, ReplicateConfig(replica_num=replica_num), 0.0)
        st.put_end(f"k{i}", 0.0, r.version)
    st.changes.clear()
    return st


def test_an_unmount_in_steps_hides_the_segment_at_once_and_ends_as_a_whole_unmount():
    """Between the sweep's steps no lookup sees a replica on the unmounted segment (an object
    left with none is a miss); at the end the table is what ``unmount`` makes at once."""
    a, b = _state(300), _state(300)
    on_s1 = [k for k in a.objects if a.objects[k].replicas[0][0] == "s1"]
    sweep = a.unmount_start("s1")
    assert a.sweep_step(sweep, 10) is False  # part of the way only
    for k in on_s1:
        assert a.get_replicas(k, 1.0).code == ObjectNotFound.code and a.exist(k, 1.0) == 0
    while not a.sweep_step(sweep, 7):
        pass
    lost = b.unmount("s1")
    assert sweep.lost == lost == len(on_s1) and not a.sweeps
    assert list(a.objects) == list(b.objects) and sorted(a.changes) == sorted(b.changes)
    assert a.cols.live == bytearray([1, 0]) and a.cols.new_sid("s9") == 1  # its id is free


def test_a_sweep_keeps_other_replicas_and_marks_the_objects_short():
    st = _state(50, segs=("s0", "s1", "s2"), replica_num=2)
    sweep = st.unmount_start("s2")
    while not st.sweep_step(sweep, 3):
        pass
    assert sweep.lost == 0 and len(st.objects) == 50
    assert all("s2" not in {s for s, _, _ in st.objects[k].replicas} for k in st.objects)
    assert st.repairs.short == {k for k in st.objects if len(st.objects[k].replicas) == 1}
    assert st.repairs.short


def test_an_eviction_pass_in_steps_evicts_what_a_whole_pass_does():
    """Without reads between its steps, a pass in small steps evicts the same objects as one
    whole pass; with reads between them (LRU moves) it still frees its target."""
    def run(step, reads=()):
        st = _state(0, segs=("s0",))
        for i in range(63):
            r = st.put_start(f"k{i}", 1_000_000, ReplicateConfig(), 0.0)
            st.put_end(f"k{i}", 0.0, r.version)
        job = st.evict_start()
        assert job is not None
        todo = iter(reads)
        while not st.evict_step(job, 1.0, step):
            k = next(todo, None)
            if k is not None and f"k{k}" in st.objects:
                st.exist(f"k{k}", 0.5)  # a lease that is over by the pass's now
        return st, job
    (a, ja), (b, jb) = run(2), run(1 << 40)
    assert list(a.objects) == list(b.objects) and ja.count == jb.count == a.evicted > 0
    c, jc = run(2, reads=range(0, 63, 5))
    assert jc.freed >= jc.target and c.used_ratio() <= c.config.high_watermark


def test_the_census_counts_what_a_walk_over_the_objects_counts():
    """Complete and pending objects, replicas (first and further, on live segments only),
    bytes, hard pins, replicas by segment: the column scans agree with the rows."""
    st = _state(40, segs=("s0", "s1", "s2"), replica_num=2)
    for i in range(5):
        st.put_start(f"open{i}", 500, ReplicateConfig(replica_num=3), 1.0)
    st.put_start("pinned", 700, ReplicateConfig(with_hard_pin=True), 1.0)
    st.put_end("pinned", 1.0)
    st.remove("k3", True, 2.0)
    st.unmount_start("s1")  # not swept yet: its replicas no longer count
    got = st.cols.census()
    objs = [st.objects[k] for k in st.objects]
    done = [o for o in objs if o.complete]
    assert (got.objects, got.pending) == (len(done), len(objs) - len(done))
    assert got.replicas == sum(len(o.replicas) for o in done) > 0
    assert got.bytes == sum(o.size for o in done)
    assert got.hard_pinned == 1
    by_seg = {s: sum(1 for o in objs for r in o.replicas if r[0] == s) for s in ("s0", "s2")}
    assert got.per_segment == by_seg


def test_repair_planning_in_steps_spends_its_budget_on_tasks_and_goes_on():
    """A step looks at short objects until its budget is spent (a task made costs
    ``TASK_COST``); the steps of one pass plan every short object."""
    from kvplane.store.master import repair

    st = _state(60, segs=("s0", "s1", "s2"), replica_num=2)
    st.unmount("s2")
    short = len(st.repairs.short)
    assert short > 20
    job = repair.PlanPass()
    assert not st.repairs.plan_step(job, 1.0, 2 * repair.TASK_COST)
    assert job.looked == 2 and len(st.repairs.pending) == 2  # 1 + 16, 1 + 16: spent
    while not st.repairs.plan_step(job, 1.0, 40):
        pass
    assert len(st.repairs.pending) == short == job.looked


def test_many_short_objects_are_bits_that_passes_scan_for(monkeypatch):
    """Past ``SHORT_LISTED`` short objects only their rows' SHORT bits hold them (no key or
    row object each); the count is then an upper bound, planning passes scan the column from
    where the last one stopped, unmark what is not short, and list rows again once none is
    left."""

    monkeypatch.setattr(columns, "SHORT_LISTED", 8)
    st = _state(60, segs=("s0", "s1", "s2"), replica_num=2)
    st.unmount("s2")
    c = st.cols
    want = {k for k in st.objects if len(st.objects[k].replicas) == 1}
    assert c.short_rows is None and len(st.repairs.short) == len(want) > 8
    assert set(st.repairs.short) == want and all(k in st.repairs.short for k in want)
    gone = sorted(want)[:3]  # they get their replica back some other way: not short now
    for k in gone:
        st.objects[k].want = 1
    assert st.repairs.under_replicated() == len(want)  # an upper bound while unlisted
    for _ in range(40):  # passes of 5: each goes on after the last
        st.repairs.plan(1.0, scan=5)
    assert set(st.repairs.pending) == want - set(gone)
    assert st.repairs.under_replicated() == len(want) - 3
    for k in list(st.repairs.pending):
        p = st.repairs.pending[k]
        assert st.repairs.done(k, p.task.gen, True, 2.0)
    assert len(st.repairs.short) == 0 and c.short_rows == set()  # listed again
    assert st.repairs.under_replicated() == 0
    assert not c.flags.tobytes().count(bytes([columns.SHORT | columns.COMPLETE]))




def test_a_put_of_a_key_lost_with_its_segment_makes_it_anew_before_the_sweep_reaches_it():
    """The key's only replica was on an unmounted segment that is not swept yet: a put of it
    must place a new object (it answered "exists" and the acknowledged put was never found),
    and the sweep, when it comes, must leave the new object alone."""
    st = _state(40)
    on_s1 = [k for k in st.objects if st.objects[k].replicas[0][0] == "s1"]
    sweep = st.unmount_start("s1")
    key = on_s1[-1]
    r = st.put_start(key, 1000, ReplicateConfig(), 1.0)
    assert r.code == 0 and [x.segment for x in r.replicas] == ["s0"]
    st.put_end(key, 1.0, r.version)
    assert st.exist(key, 1.0) == 1
    while not st.sweep_step(sweep, 3):
        pass
    assert st.get_replicas(key, 2.0).code == 0 and st.objects[key].replicas[0][0] == "s0"
    assert sweep.lost == len(on_s1) - 1
