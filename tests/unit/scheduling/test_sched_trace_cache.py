"""Trace format, turn inference, LRU tiers and their mirroring into the conductor's prefix index."""

import json
import random

import pytest

from kvplane.common.errors import InvalidArgument
from kvplane.conductor.indexer import PrefixIndex
from kvplane.conductor.scheduling.cache import InstanceCache, LruTier, PoolCache, walk
from kvplane.conductor.scheduling.prefix import POOL, IndexPrefixes
from kvplane.conductor.scheduling.trace import load_trace, parse_lines, turns
from kvplane.kvevents import Tier

pytestmark = pytest.mark.timeout(10)


def line(ts, n, out, hashes, **extra):
    return json.dumps({"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": hashes, **extra})


def test_parse_sorts_scales_and_ignores_extra_keys():
    reqs = parse_lines([line(3000, 600, 5, [0, 1]), "", line(1000, 10, 1, [2], session="x")], load=2.0)
    assert [r.rid for r in reqs] == [1, 0]
    assert reqs[0].arrival_s == pytest.approx(0.5) and reqs[1].arrival_s == pytest.approx(1.5)
    assert reqs[1].hash_ids == (0, 1) and reqs[1].input_length == 600
    assert len(parse_lines([line(0, 1, 1, [0])] * 5, limit=3)) == 3


@pytest.mark.parametrize("bad", ["not json", json.dumps({"timestamp": 0}),
                                 line(0, 0, 1, [0]), line(0, 5, 1, ["x"])])
def test_bad_lines_raise(bad):
    with pytest.raises(InvalidArgument, match="line 1"):
        parse_lines([bad])


def test_missing_file_raises(tmp_path):
    with pytest.raises(InvalidArgument):
        load_trace(tmp_path / "nope.jsonl")


def test_turns_follow_hash_chains_not_the_shared_head():
    reqs = parse_lines([
        line(0, 1600, 1, [0, 1, 2, 3]),           # session A turn 1 (3 full blocks)
        line(1, 1100, 1, [0, 9, 10]),             # session B turn 1: shares only block 0
        line(2, 2600, 1, [0, 1, 2, 3, 4, 5]),     # A turn 2: contains A's full blocks
        line(3, 3700, 1, [0, 1, 2, 3, 4, 5, 6, 7]),  # A turn 3
        line(4, 600, 1, [0, 11]),                 # C: one full block, never a predecessor
        line(5, 700, 1, [0, 12]),
    ])
    assert turns(reqs) == {0: 1, 1: 1, 2: 2, 3: 3, 4: 1, 5: 1}


def test_lru_tier_evicts_least_recent_and_reports_net_changes():
    t = LruTier(3)
    assert t.touch([1, 2, 3]) == ([3, 2, 1], [])
    t.touch([2])  # tail-first put 1 last (most recent); now 2 is, and 3 is the oldest
    new, gone = t.touch([4])
    assert new == [4] and gone == [3] and 3 not in t and len(t) == 3
    # a batch longer than the tier: net result only
    new, gone = t.touch([10, 11, 12, 13])
    assert sorted(new) == [10, 11, 12] and sorted(gone) == [1, 2, 4] and 13 not in t
    assert LruTier(0).touch([1]) == ([], [])


def test_caches_stay_consistent_with_the_index():
    idx = PrefixIndex()
    src = IndexPrefixes(idx, ["p0", "p1"], pool=True)
    caches = [InstanceCache("p0", 5, 12, src), InstanceCache("p1", 3, 0, src)]
    pool = PoolCache(20, src, POOL)
    rng = random.Random(3)
    for _ in range(300):
        chain = [rng.randrange(40) for _ in range(rng.randrange(1, 8))]
        c = rng.choice(caches)
        c.put(chain)
        pool.put(chain)
    for c in caches:
        for tier, lru in ((Tier.GPU, c.gpu), (Tier.CPU, c.cpu)):
            assert idx.held_by(src.ctx, src.holder(c.name, tier)) == len(lru)
            for h in lru.blocks:
                assert src.holder(c.name, tier) in idx.holders(src.ctx, h)
    assert idx.held_by(src.ctx, src.holder(POOL, Tier.DISK)) == len(pool.lru)


def test_walk_and_index_agree_on_prefix_lengths():
    idx = PrefixIndex()
    src = IndexPrefixes(idx, ["p0", "p1"], pool=True)
    p0, p1 = InstanceCache("p0", 2, 4, src), InstanceCache("p1", 10, 10, src)
    pool = PoolCache(100, src)
    p0.put([1, 2, 3, 4])          # GPU keeps the head [1, 2], DRAM all four
    p1.put([1, 2, 3, 4, 5, 6])
    pool.put([1, 2, 3, 4, 5, 6, 7, 8])
    chain = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert walk(chain, p0, None, None) == (2, 4, 4, 4)
    assert walk(chain, p0, p1, pool) == (2, 4, 6, 8)
    m = src.match(chain)
    assert (m["p0"].gpu, m["p0"].cpu, m["p0"].longest) == (2, 4, 8)
    assert (m["p1"].gpu, m["p1"].cpu, m["p1"].longest) == (6, 6, 8)
