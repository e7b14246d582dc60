"""Copy/move tasks on the master state (pure: an explicit timeline, no sockets), and the soft-pin
actions of a put."""

import pytest

from kvplane.store.errors import InvalidParams
from kvplane.store.master.config import MasterConfig
from kvplane.store.master.state import MasterState
from kvplane.store.master.tasks import TASK_NOT_FOUND, TASK_PENDING_LIMIT_EXCEEDED, Tasks
from kvplane.store.replica_types import TaskId
from kvplane.store.types import ReplicateConfig, SegmentInfo

pytestmark = pytest.mark.timeout(10)
MB = 1 << 20


def state(n=3):
    st = MasterState(MasterConfig(lease_ttl=1.0), seed=1)
    for i in range(n):
        st.mount(f"c{i}", [SegmentInfo(f"s{i}", 1_000_000 * (i + 1), MB, "", f"h:{i}", "host")], 0.0)
    return st


def put(st, key, size=1000, segment="s0", now=0.0, **cfg):
    r = st.put_start(key, size, ReplicateConfig(preferred_segment=segment, **cfg), now)
    assert r.code == 0 and st.put_end(key, now, r.version) == 0
    return r


def used(st, name):
    return st.segments[name].alloc.used


def test_create_checks_key_and_segments_like_mooncake():
    st = state()
    tasks = Tasks(st)
    put(st, "k")
    assert tasks.create("copy", "nope", ["s1"], "", "c", 0.0, 1)[0] == -704
    assert tasks.create("copy", "k", ["unknown"], "", "c", 0.0, 1)[0] == InvalidParams.code
    assert tasks.create("move", "k", ["s1"], "s0", "c", 0.0, 1)[0] == 0
    assert tasks.create("move", "k", ["s0"], "s0", "c", 0.0, 1)[0] == InvalidParams.code  # same
    assert tasks.create("move", "k", ["s2"], "s1", "c", 0.0, 1)[0] == InvalidParams.code  # no replica
    assert tasks.query(TaskId(1, 2)).code == TASK_NOT_FOUND


def test_copy_allocates_targets_with_generations_and_joins_them():
    st = state()
    tasks = Tasks(st)
    put(st, "k")
    code, tid = tasks.create("copy", "k", ["s1", "s2", "s0"], "", "c", 0.0, 1)
    assert code == 0 and tasks.query(tid).status == "PENDING"
    work = tasks.start(tid, "runner", 0.0, 2)
    assert work.code == 0 and len(work.targets) == 2  # s0 already holds it
    assert all(t.gen > 0 for t in work.targets) and work.sources[0].segment == "s0"
    assert st.objects["k"].lease_until > 0  # protected while copying
    assert st.remove("k", False, 0.5) < 0
    assert tasks.finish(tid, [True, True], "", 1.0, 3) == 0
    info = tasks.query(tid)
    assert info.status == "SUCCESS" and info.assigned_client == "runner"
    assert sorted(s for s, _, _ in st.objects["k"].replicas) == ["s0", "s1", "s2"]
    assert st.objects["k"].want == 3  # re-replication keeps the copies


def test_move_drops_the_source_and_a_failed_target_is_freed():
    st = state()
    tasks = Tasks(st)
    put(st, "k")
    _, tid = tasks.create("move", "k", ["s1"], "s0", "c", 0.0, 1)
    tasks.start(tid, "c", 0.0, 1)
    assert tasks.finish(tid, [True], "", 5.0, 2) == 0
    assert [s for s, _, _ in st.objects["k"].replicas] == ["s1"]
    assert used(st, "s0") > 0  # a reader inside the lease may still be reading the source
    st.reclaim(7.0)
    assert used(st, "s0") == 0
    _, tid2 = tasks.create("copy", "k", ["s2"], "", "c", 5.0, 3)
    tasks.start(tid2, "c", 5.0, 3)
    assert used(st, "s2") > 0
    assert tasks.finish(tid2, [False], "boom", 6.0, 4) == 0
    assert tasks.query(tid2).status == "FAILED" and used(st, "s2") == 0


def test_an_abandoned_task_fails_and_its_target_waits_for_a_fence():
    st = state()
    tasks = Tasks(st, processing_timeout=10.0)
    put(st, "k")
    _, tid = tasks.create("copy", "k", ["s1"], "", "c", 0.0, 1)
    work = tasks.start(tid, "c", 0.0, 1)
    assert tasks.expire(5.0, 2) == 0
    assert tasks.expire(11.0, 3) == 1
    assert tasks.query(tid).status == "FAILED"
    gen = work.targets[0].gen
    assert gen in st.fences_for("c1")  # the runner may still write: fenced before reuse
    assert used(st, "s1") > 0
    assert tasks.finish(tid, [True], "", 12.0, 4) == InvalidParams.code  # too late


def test_pending_limit_and_pruning():
    st = state()
    tasks = Tasks(st, max_pending=1, max_finished=1)
    put(st, "k")
    assert tasks.create("copy", "k", ["s1"], "", "c", 0.0, 1)[0] == 0
    assert tasks.create("copy", "k", ["s2"], "", "c", 0.0, 1)[0] == TASK_PENDING_LIMIT_EXCEEDED
    tid = next(iter(tasks.tasks.values())).id
    tasks.start(tid, "c", 0.0, 1)
    tasks.finish(tid, [True], "", 0.0, 1)
    _, t2 = tasks.create("copy", "k", ["s2"], "", "c", 0.0, 1)
    tasks.start(t2, "c", 0.0, 1)
    tasks.finish(t2, [True], "", 0.0, 1)
    assert tasks.query(tid).code == TASK_NOT_FOUND and tasks.query(t2).status == "SUCCESS"


def test_soft_pin_actions():
    st = state()
    put(st, "k", soft_pin_action="enable", soft_pin_ttl_ms=60_000)
    deadline = st.objects["k"].soft_pin_until
    assert deadline == 60.0
    r = st.put_start("k", 1000, ReplicateConfig(), 1.0, upsert=True)  # preserve
    st.put_end("k", 1.0, r.version)
    assert st.objects["k"].soft_pin_until == deadline
    r = st.put_start("k", 1000, ReplicateConfig(soft_pin_action="disable"), 2.0, upsert=True)
    st.put_end("k", 2.0, r.version)
    assert st.objects["k"].soft_pin_until == 0.0
    bad = [ReplicateConfig(soft_pin_ttl_ms=5), ReplicateConfig(soft_pin_action="maybe"),
           ReplicateConfig(soft_pin_action="enable", soft_pin_ttl_ms=10**12)]
    assert [st.put_start(f"b{i}", 10, c, 3.0).code for i, c in enumerate(bad)] == \
        [InvalidParams.code] * 3
