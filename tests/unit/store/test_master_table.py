"""The master's layers seen from their public faces: the object table alone, the eviction
policy and its verdicts, and RPC modules that export handlers over a swappable ``Serving``."""

from kvplane.store.errors import ObjectNotFound
from kvplane.store.master import eviction, replica_rpc, tier_rpc
from kvplane.store.master.config import MasterConfig
from kvplane.store.master.eviction import Verdict
from kvplane.store.master.serving import Serving
from kvplane.store.master.state import MasterState
from kvplane.store.master.table import STORED, Obj, ObjectTable
from kvplane.store.master.tasks import TASK_NOT_FOUND
from kvplane.store.replica_types import ReplicaClearReq, TaskCreateReq, TaskReq
from kvplane.store.types import KeysReq, ReplicateConfig, SegmentInfo

MB = 1 << 20


class Hooks:
    """Stands in for repair, adoption and the disk tier: records what the table tells them."""

    def __init__(self):
        self.short: set[str] = set()
        self.calls: list[tuple[str, str]] = []

    def forget(self, *args):
        self.calls.append(("forget", str(args[0]) if isinstance(args[0], str) else "header"))

    def stored(self, key, obj):
        self.calls.append(("stored", key))

    def dropped(self, key, obj, now):
        self.calls.append(("dropped", key))

    def verdict(self, key, obj, now):
        return Verdict.DROP

    def demote(self, key, obj, now):
        raise AssertionError("never asked: the verdict is DROP")


def bare_table(n_segs=2):
    from kvplane.store.master.allocator import OffsetAllocator
    from kvplane.store.master.table import Client, Segment

    table = ObjectTable(MasterConfig(), seed=1)
    hooks = Hooks()
    table.repairs = table.adoption = table.tiers = hooks
    table.clients["c"] = Client(0.0)
    for i in range(n_segs):
        info = SegmentInfo(f"s{i}", i * 10 * MB, MB, "c", f"h:{i}", "host")
        table.add_segment(Segment(info, OffsetAllocator(info.size)))
        table.clients["c"].segments.add(info.name)
    return table, hooks


def test_the_object_table_works_alone_and_tells_its_services():
    """No MasterState: place, commit and drop through the public API; the hooks hear it."""
    table, hooks = bare_table()
    cfg = ReplicateConfig(replica_num=2)
    reps = table.place(1000, cfg, 0.0, frozenset())
    assert sorted(s for s, _, _ in reps) == ["s0", "s1"] and len({g for _, _, g in reps}) == 1
    assert reps[0][2] == table.floor() - 1  # one generation for the put, the last issued
    table.insert("k", Obj(1000, tuple(reps), False, 0.0, version=reps[0][2], want=3))
    assert table.put_end("k", 1.0, reps[0][2]) == 0
    assert (STORED, "k") in table.changes and "k" in hooks.short  # 2 of 3 replicas
    assert ("stored", "k") in hooks.calls
    table.drop_object("k", table.objects["k"], 2.0)
    assert "k" not in table.objects and ("dropped", "k") in hooks.calls
    assert sum(s.alloc.used for s in table.segments.values()) == 0  # no lease: freed at once
    assert table.segments_of("c") == {"s0", "s1"} and table.segments_of("nobody") == set()


def test_eviction_policy_and_its_verdicts():
    cfg = MasterConfig()
    assert eviction.target_bytes(cfg, used=10, held=0, cap=100, need=0) == 0
    over = eviction.target_bytes(cfg, used=100, held=0, cap=100, need=0)
    assert over > 0 and eviction.target_bytes(cfg, 100, 100, 100, 0) == 0  # all held: none
    assert eviction.target_bytes(cfg, 10, 0, 100, need=7) == 7
    obj = Obj(1, (("s0", 0, 1),), True, 0.0)
    assert eviction.evictable(obj, 1.0, soft_pass=False)
    assert not eviction.evictable(Obj(1, (("s0", 0, 1),), True, 0.0, lease_until=2.0), 1.0, False)
    assert not eviction.evictable(Obj(1, (), True, 0.0), 1.0, False)  # nothing in memory
    soft = Obj(1, (("s0", 0, 1),), True, 0.0, soft_pin_until=5.0)
    assert not eviction.evictable(soft, 1.0, False) and eviction.evictable(soft, 1.0, True)
    st = MasterState(MasterConfig(), seed=1)
    st.mount("c0", [SegmentInfo("s0", 0, MB, "", "h:0", "host")], 0.0)
    st.put_start("k", 100, ReplicateConfig(), 0.0)
    st.put_end("k", 0.0)
    assert st.tiers.verdict("k", st.objects["k"], 1.0) is Verdict.DROP  # no disk tier


def served(epoch=1):
    st = MasterState(MasterConfig(), seed=1, epoch=epoch)
    st.mount("c0", [SegmentInfo(f"s{i}", i * 10 * MB, MB, "", f"h:{i}", "host")
                    for i in range(2)], 0.0)
    return st


def test_rpc_modules_export_their_handlers():
    serving = Serving(served(), lambda: 0.0)
    rep = replica_rpc.handlers(serving)
    assert set(rep) == {"replica_descs", "replica_clear", "task_create", "task_start",
                        "task_done", "task_query"}
    assert rep["replica_descs"][1] is KeysReq and rep["replica_clear"][1] is ReplicaClearReq
    tier = tier_rpc.handlers(serving)
    assert set(tier) == {"disk_sync", "disk_adopt", "promote_start", "promote_end"}
    assert all(callable(fn) and isinstance(typ, type) for fn, typ in (*rep.values(), *tier.values()))


def test_handlers_follow_the_served_state_across_a_swap():
    """A leader change swaps ``serving.state``: handlers built once see the new state, and the
    old term's tasks are gone."""
    first = served(epoch=1)
    r = first.put_start("k", 100, ReplicateConfig(), 0.0)
    first.put_end("k", 0.0, r.version)
    serving = Serving(first, lambda: 1.0)
    rpc = replica_rpc.handlers(serving)
    descs, create, query = (rpc[n][0] for n in ("replica_descs", "task_create", "task_query"))
    assert descs(KeysReq("c0", ["k"])).results[0].code == 0
    made = create(TaskCreateReq("c0", "copy", "k", ["s0", "s1"]))
    assert made.code == 0 and query(TaskReq("c0", made.task)).code == 0
    serving.state = served(epoch=2)
    assert descs(KeysReq("c0", ["k"])).results[0].code == ObjectNotFound.code
    assert query(TaskReq("c0", made.task)).code == TASK_NOT_FOUND
