"""The object table's storage (issue 32): the key index, rows, replica rows, the LRU list, and
the passes in steps (an unmount's sweep, an eviction pass)."""

import random

import pytest

from kvplane.common.errors import InvalidArgument
from kvplane.store.errors import ObjectNotFound
from kvplane.store.master import columns
from kvplane.store.master.allocator import ALIGN, OffsetAllocator
from kvplane.store.master.columns import Columns, KeyIndex
from kvplane.store.master.config import MasterConfig
from kvplane.store.master.state import MasterState
from kvplane.store.types import ReplicateConfig, SegmentInfo

MB = 1 << 20


def test_key_index_matches_a_dict_through_growth_and_removals():
    """Random adds and removals (with shards growing, and removals shifting entries back):
    every key is found at its row, every removed key is gone."""
    rng = random.Random(3)
    keys: list = []
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
            index.add(keys[-1], len(keys) - 1)
            model[key] = len(keys) - 1
    assert all(index.find(k) == r for k, r in model.items())
    assert all(index.find(k) == -1 for k in (f"key-{rng.randrange(1 << 40)}x" for _ in range(1000)))
    gone = [k for k in keys if k is not None and k.decode() not in model]
    assert not gone


def test_key_index_shards_grow_alone():
    """A shard doubles when two thirds full; the others keep their size (a growth rehashes
    about 1/SHARDS of the keys)."""
    keys: list = []
    index = KeyIndex(keys)
    for i in range(columns.SHARDS * 8):
        keys.append(f"k{i}".encode())
        index.add(keys[-1], i)
    sizes = [len(s) for s in index._shards]
    assert max(sizes) > min(sizes) and sum(sizes) < 8 * columns.SHARDS * 8


def test_rows_are_reused_and_the_lru_list_stays_whole():
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
    ``TASK_COST``); steps that go on after what the last looked at plan every short object."""
    from kvplane.store.master import repair

    st = _state(60, segs=("s0", "s1", "s2"), replica_num=2)
    st.unmount("s2")
    short = len(st.repairs.short)
    assert short > 20
    looked = st.repairs.plan_step(1.0, 2 * repair.TASK_COST, 0)
    assert looked == 2 and len(st.repairs.pending) == 2  # 1 + 16, 1 + 16: spent
    done = looked
    while (n := st.repairs.plan_step(1.0, 40, done)):
        done += n
    assert len(st.repairs.pending) == short and done >= short


def test_the_sharded_set_is_a_set():
    from kvplane.store.master.columns import ShardedSet

    s, model = ShardedSet(), set()
    rng = random.Random(5)
    for _ in range(20_000):
        k = f"k{rng.randrange(3000)}"
        if rng.random() < 0.5:
            s.add(k)
            model.add(k)
        else:
            s.discard(k)
            model.discard(k)
    assert s == model and len(s) == len(model) and sorted(s) == sorted(model)
    assert all(k in s for k in model) and "nope" not in s
