"""Index semantics: complete-block prefixes, first-miss stop, tiers, DP ranks, removal, clear."""

import pytest

from kvplane.conductor.indexer import ContextKey, Holder, PrefixIndex
from kvplane.kvevents import Tier

pytestmark = pytest.mark.timeout(10)
CTX = ContextKey("t", "m", "", 16, "")
CHAIN = [101, 102, 103, 104, 105]


def gpu(inst, rank=0):
    return Holder(inst, rank, Tier.GPU)


def test_prefix_stops_at_first_miss():
    ix = PrefixIndex()
    ix.store(CTX, gpu("a"), [101, 102, 104])  # 103 missing: 104 must not count
    r = ix.match(CTX, CHAIN)
    assert r["a"].gpu == 2 and r["a"].longest == 2 and r["a"].dp == {0: 2}


def test_lazy_hashes_consumed_only_until_all_cursors_stop():
    ix = PrefixIndex()
    ix.store(CTX, gpu("a"), [101])
    pulled = []

    def gen():
        for h in CHAIN:
            pulled.append(h)
            yield h

    assert ix.match(CTX, gen())["a"].gpu == 1
    assert pulled == [101, 102]  # 102 missed: the walk stopped there


def test_contexts_are_isolated():
    ix = PrefixIndex()
    ix.store(CTX, gpu("a"), CHAIN)
    other = ContextKey("t", "m", "lora-x", 16, "")
    assert ix.match(other, CHAIN, {"a": [0]})["a"].longest == 0
    assert ix.match(ContextKey("t", "m", "", 32, ""), CHAIN, {"a": [0]})["a"].longest == 0


def test_tiers_are_cumulative_gpu_then_cpu_then_disk():
    ix = PrefixIndex()
    ix.store(CTX, gpu("a"), CHAIN[:1])
    ix.store(CTX, Holder("a", 0, Tier.CPU), CHAIN[1:3])
    ix.store(CTX, Holder("a", 0, Tier.DISK), CHAIN[3:4])
    m = ix.match(CTX, CHAIN)["a"]
    assert (m.gpu, m.cpu, m.disk, m.longest) == (1, 3, 4, 4)


def test_cursor_does_not_return_to_gpu_after_leaving_it():
    ix = PrefixIndex()
    ix.store(CTX, gpu("a"), [101, 103, 104])
    ix.store(CTX, Holder("a", 0, Tier.CPU), [102])
    m = ix.match(CTX, CHAIN)["a"]
    assert (m.gpu, m.cpu, m.disk) == (1, 2, 2)


def test_dp_ranks_reported_separately_instance_takes_max():
    ix = PrefixIndex()
    ix.store(CTX, gpu("a", 0), CHAIN[:2])
    ix.store(CTX, gpu("a", 1), CHAIN[:4])
    m = ix.match(CTX, CHAIN, {"a": [0, 1, 2]})["a"]
    assert m.dp == {0: 2, 1: 4, 2: 0} and m.gpu == 4 and m.longest == 4


def test_other_ranks_cpu_counts_for_the_instance_but_not_other_instances():
    ix = PrefixIndex()
    ix.store(CTX, Holder("a", 1, Tier.CPU), CHAIN)
    r = ix.match(CTX, CHAIN, {"a": [0], "b": [0]})
    assert r["a"].cpu == 5 and r["a"].gpu == 0 and r["b"].longest == 0


def test_shared_pool_tiers_extend_every_instance_and_are_not_reported():
    ix = PrefixIndex()
    ix.store(CTX, gpu("a"), CHAIN[:1])
    ix.store(CTX, Holder("store", 0, Tier.CPU), CHAIN[:3])
    ix.store(CTX, Holder("store", 0, Tier.DISK), CHAIN)
    r = ix.match(CTX, CHAIN, {"a": [0], "b": [0]}, shared={"store"})
    assert (r["a"].gpu, r["a"].cpu, r["a"].disk) == (1, 3, 5)
    assert (r["b"].gpu, r["b"].cpu, r["b"].disk) == (0, 3, 5)
    assert set(ix.match(CTX, CHAIN, shared={"store"})) == {"a"}


def test_whole_chain_matched_and_empty_query():
    ix = PrefixIndex()
    ix.store(CTX, gpu("a"), CHAIN)
    assert ix.match(CTX, CHAIN)["a"].longest == 5
    assert ix.match(CTX, [])["a"].longest == 0
    assert ix.match(ContextKey(), CHAIN, {"z": [0]})["z"].longest == 0


def test_remove_and_multiple_holders():
    ix = PrefixIndex()
    assert ix.store(CTX, gpu("a"), CHAIN) == 5
    assert ix.store(CTX, gpu("a"), CHAIN) == 0  # idempotent
    ix.store(CTX, gpu("b"), CHAIN[:3])
    assert ix.remove(CTX, gpu("a"), [102, 999]) == 1
    r = ix.match(CTX, CHAIN)
    assert r["a"].gpu == 1 and r["b"].gpu == 3
    assert set(ix.holders(CTX, 101)) == {gpu("a"), gpu("b")}
    assert ix.holders(CTX, 102) == [gpu("b")]
    ix.remove(CTX, gpu("b"), CHAIN)
    assert 102 not in ix._ctx[CTX].blocks  # no empty entries left behind
    assert ix.remove(CTX, gpu("nobody"), CHAIN) == 0


def test_clear_one_rank_one_tier_and_all():
    ix = PrefixIndex()
    ix.store(CTX, gpu("a", 0), CHAIN)
    ix.store(CTX, gpu("a", 1), CHAIN)
    ix.store(CTX, Holder("a", 0, Tier.CPU), CHAIN)
    ix.store(CTX, gpu("b"), CHAIN)
    assert ix.clear(CTX, "a", dp_rank=0, tiers={Tier.GPU}) == 5
    m = ix.match(CTX, CHAIN, {"a": [0, 1]})["a"]
    assert m.dp == {0: 0, 1: 5} and m.cpu == 5
    assert ix.clear(None, "a") == 10
    r = ix.match(CTX, CHAIN, {"a": [0, 1], "b": [0]})
    assert r["a"].longest == 0 and r["b"].longest == 5
    assert ix.held_by(CTX, gpu("b")) == 5 and ix.held_by(CTX, gpu("a")) == 0


def test_drop_instance_releases_slots_for_reuse():
    ix = PrefixIndex()
    ix.store(CTX, gpu("a"), CHAIN)
    ix.store(CTX, gpu("b"), CHAIN[:2])
    assert ix.drop_instance("a") == 5
    ix.store(CTX, gpu("c"), CHAIN[:1])  # reuses a's slot: must not inherit a's blocks
    r = ix.match(CTX, CHAIN)
    assert set(r) == {"b", "c"} and r["c"].gpu == 1 and r["b"].gpu == 2
    assert ix.stats() == {"contexts": 1, "blocks": 2, "entries": 3, "holders": 2}


def test_many_instances_bitmask_beyond_64_slots():
    ix = PrefixIndex()
    for i in range(100):
        ix.store(CTX, gpu(f"i{i}"), CHAIN[: i % 6])
    r = ix.match(CTX, CHAIN)
    assert all(r[f"i{i}"].gpu == i % 6 for i in range(100) if i % 6)
