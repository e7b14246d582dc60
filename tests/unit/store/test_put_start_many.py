"""``MasterState.put_start_many`` (a PutStart call's keys in one pass, issue 32) against
``put_start`` key by key: the same answers and the same table, whatever the keys are."""

from dataclasses import astuple

import pytest

from kvplane.store.errors import InvalidKey, NoAvailableHandle, ObjectExists, ValueTooLarge
from kvplane.store.master.columns import _OBJECT_COLUMNS, _REPLICA_COLUMNS
from kvplane.store.master.config import MasterConfig
from kvplane.store.master.state import MasterState
from kvplane.store.types import MAX_KEY, ReplicateConfig, SegmentInfo

MB = 1 << 20


def state(n_segs: int = 1, seg_size: int = MB, **cfg) -> MasterState:
    st = MasterState(MasterConfig(**cfg), seed=1)
    st.secret = b"s" * 32
    for i in range(n_segs):
        st.mount(f"c{i}", [SegmentInfo(f"s{i}", 1_000_000 * (i + 1), seg_size, f"c{i}",
                                       f"h:{i}", "host")], 0.0)
    return st


def table(st: MasterState) -> dict:
    """Everything the table holds: every column of every row used, the keys, the unfinished
    puts, the LRU order, the allocators' free space, the generation counter, the owners."""
    c = st.cols
    lru, row = [], c.head
    while row >= 0:
        lru.append(row)
        row = c.nxt[row]
    return {
        "columns": {n: list(getattr(c, n))[:c._top] for n, _ in _OBJECT_COLUMNS},
        "replicas": {n: list(getattr(c, n))[:c._rtop] for n, _ in _REPLICA_COLUMNS},
        "keys": [c.keys[r] for r in range(c._top)],
        "found": {c.keys[r]: c.index.find(c.keys[r].decode()) for r in range(c._top)
                  if c.keys[r] is not None},
        "puts": {r: astuple(p) for r, p in c.puts.items()},
        "lru": lru, "count": c.count, "owners": list(c.owners), "pins": dict(c.pins),
        "free": {n: (list(s.alloc._by_off), s.alloc.used) for n, s in st.segments.items()},
        "gen": st._next_gen,
    }


def both(calls: list[tuple[list[str], list[int], ReplicateConfig]], n_segs: int = 1,
         seg_size: int = MB, prepare=None, **cfg) -> tuple[list, MasterState]:
    """Run ``calls`` (keys, sizes, config) on two equal states, one through put_start_many
    and one key by key; assert the answers and the tables equal; return the answers."""
    a, b = state(n_segs, seg_size, **cfg), state(n_segs, seg_size, **cfg)
    if prepare:
        prepare(a)
        prepare(b)
    answers = []
    for n, (keys, sizes, config) in enumerate(calls):
        now, sums = 1.0 + n, [0x1000 + i for i in range(len(keys))]
        window = a.write_window(2.5)

        def one(st: MasterState, i: int, keys=keys, sizes=sizes, config=config, now=now,
                sums=sums, window=window) -> object:
            return st.put_start(keys[i], sizes[i], config, now, False, frozenset(), "cl",
                                window, sums[i], 77, owner="cl")

        got = a.put_start_many(keys, sizes, sums, config, now, "cl", window, 77,
                               lambda i: one(a, i))
        want = [one(b, i) for i in range(len(keys))]
        assert got == want
        assert table(a) == table(b)
        for k, r in zip(keys, got, strict=True):  # and every put that started ends alike
            if r.code == 0 and a.objects[k].version == r.version:
                assert a.put_end(k, now, r.version, 5) == b.put_end(k, now, r.version, 5) == 0
        assert table(a) == table(b)
        answers.append(got)
    return answers, a


def test_fresh_keys_on_one_segment_take_the_one_pass_and_answer_as_key_by_key():
    cfgs = [ReplicateConfig(), ReplicateConfig(with_hard_pin=True),
            ReplicateConfig(with_soft_pin=True), ReplicateConfig(soft_pin_action="enable")]
    calls = [([f"k{n}-{i}" for i in range(32)], [4096 + 64 * i for i in range(32)], cfg)
             for n, cfg in enumerate(cfgs)]
    answers, st = both(calls)
    assert all(r.code == 0 for rs in answers for r in rs)
    assert st.cols.count == 128 and len({r.version for rs in answers for r in rs}) == 128


def test_every_key_the_one_pass_does_not_take_gets_put_starts_answer_in_its_turn():
    """Present keys (complete or being written), duplicates in the call, bad keys and sizes,
    values larger than any segment: each key's answer is put_start's, in order."""
    def prepare(st: MasterState) -> None:
        st.put_start("done", 100, ReplicateConfig(), 0.5)
        st.put_end("done", 0.5)
        st.put_start("open", 100, ReplicateConfig(), 0.5)

    keys = ["a", "done", "b", "open", "a", "", "x" * (MAX_KEY + 1), "c", "d", "e"]
    sizes = [10, 10, 10, 10, 10, 10, 10, 0, 2 * MB, 10]
    (got,), _ = both([(keys, sizes, ReplicateConfig())], prepare=prepare)
    assert [r.code for r in got[:7]] == [0, ObjectExists.code, 0, ObjectExists.code, 0,
                                         InvalidKey.code, InvalidKey.code]
    assert got[4].replicas == got[0].replicas  # the same writer and call id: a resumed put
    assert got[7].code < 0 and got[8].code == ValueTooLarge.code and got[9].code == 0


def test_out_of_room_and_the_key_limit_go_the_full_way():
    """A full segment (eviction, then NoAvailableHandle) and max_keys: put_start's answers."""
    keys = [f"k{i}" for i in range(12)]
    (got,), st = both([(keys, [100_000] * 12, ReplicateConfig())])  # 1 MB: about 10 fit
    assert got[-1].code == NoAvailableHandle.code and got[0].code == 0
    (got,), _ = both([(keys, [10] * 12, ReplicateConfig())], max_keys=5)
    assert [r.code for r in got] == [0] * 5 + [NoAvailableHandle.code] * 7


@pytest.mark.parametrize("cfg, n_segs", [(ReplicateConfig(replica_num=2), 2),
                                         (ReplicateConfig(), 3),
                                         (ReplicateConfig(preferred_segment="s1"), 2)])
def test_several_candidates_or_replicas_go_key_by_key(cfg, n_segs):
    (got,), _ = both([([f"k{i}" for i in range(8)], [1000] * 8, cfg)], n_segs=n_segs)
    assert all(r.code == 0 for r in got)


def test_a_suspect_or_adopting_segment_is_no_candidate():
    def prepare(st: MasterState) -> None:
        st.segments["s0"].adopting = True

    (got,), _ = both([(["a", "b"], [10, 10], ReplicateConfig())], n_segs=2, prepare=prepare)
    assert {r.replicas[0].segment for r in got} == {"s1"}
