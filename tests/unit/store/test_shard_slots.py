"""Hash slots, the shard map, and what a shard does with each slot (``kvplane.store.shard``)."""

import pytest

from kvplane.common.errors import InvalidArgument
from kvplane.store.shard.shares import even as even_shares
from kvplane.store.shard.slots import (
    IN,
    OTHER,
    OUT,
    OWN,
    SLOTS,
    Move,
    ShardInfo,
    ShardMap,
    SlotTable,
    even,
    owners,
    ranges,
    reassign,
    runs_of,
    slot_of,
    slot_of_internal,
)


def shards(n):
    return [ShardInfo(i, f"h:{i}") for i in range(n)]


def test_slots_are_stable_and_hash_tags_group_keys():
    assert slot_of("abc") == slot_of("abc") and 0 <= slot_of("abc") < SLOTS
    assert slot_of("{req-17}/layer-3") == slot_of("{req-17}/layer-4") == slot_of("req-17")
    assert slot_of("{}x") == slot_of("{}x")  # an empty tag hashes the whole key
    assert slot_of_internal("\x00tenant\x00{t}k") == slot_of("{t}k")
    spread = {slot_of(f"key-{i}") for i in range(5000)}
    assert len(spread) > 3500  # CRC-32 spreads keys over the slots


def test_even_map_covers_every_slot_once():
    m = even(shards(3))
    own = owners(m)
    assert [own.count(i) for i in range(3)] == [5461, 5461, 5462]
    assert runs_of(own) == m.runs


def test_reassign_moves_exactly_the_slots_named():
    m = even(shards(2))
    moved = reassign(m, range(100, 200), 0)
    assert moved.version == m.version + 1
    before, after = owners(m), owners(moved)
    assert [s for s in range(SLOTS) if before[s] != after[s]] == \
        [s for s in range(100, 200) if before[s] != 0]
    assert ranges([5, 1, 2, 3, 9, 10]) == [(1, 4), (5, 6), (9, 11)]


@pytest.mark.parametrize("bad", [
    ShardMap(1, [ShardInfo(0, "a"), ShardInfo(0, "b")], [(0, 0)]),
    ShardMap(1, [ShardInfo(0, "a")], [(1, 0)]),
    ShardMap(1, [ShardInfo(0, "a")], [(0, 0), (0, 0)]),
    ShardMap(1, [ShardInfo(0, "a")], [(0, 1)]),
    ShardMap(1, [ShardInfo(64, "a")], [(0, 64)]),
    ShardMap(1, shards(2), [(0, 0)], [Move(5, 5, 0, 1)]),
])
def test_malformed_maps_are_refused(bad):
    with pytest.raises(InvalidArgument):
        reassign(bad, [], 0)


def test_slot_states_follow_the_map_and_its_moves():
    m = even(shards(2))
    half = SLOTS // 2
    moving = ShardMap(2, m.shards, m.runs, [Move(0, 10, 0, 1)])
    a, b = SlotTable(moving, 0), SlotTable(moving, 1)
    assert a.state[0] == OUT and b.state[0] == IN
    assert a.state[10] == OWN and b.state[10] == OTHER
    assert a.state[half] == OTHER and b.state[half] == OWN
    assert a.slots(OUT) == list(range(10))


def test_shares_are_disjoint_aligned_and_cover_the_segment():
    size = (32 << 20) - 512
    cut = even_shares(size, [3, 0, 1])
    spans = sorted(cut.values())
    assert spans[0][0] == 0 and sum(n for _, n in spans) == size
    assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))
    assert all(off % 4096 == 0 for off, _ in spans)
    assert [cut[i][0] for i in (0, 1, 3)] == sorted(cut[i][0] for i in (0, 1, 3))


def test_a_share_resized_keeps_its_allocations_and_gives_up_only_a_free_tail():
    from kvplane.store.master.allocator import OffsetAllocator
    from kvplane.store.shard.move_rpc import MoveRpc
    a = OffsetAllocator(1 << 20)
    x, y = a.allocate(4096), a.allocate(10_000)
    assert x == 0 and y == 4096
    assert a.free_tail() == 4096 + 10_048
    assert MoveRpc._free_tail(a, 0) == 16384  # the first page boundary past the last block
    assert MoveRpc._free_tail(a, 500_000) == 503_808
    with pytest.raises(InvalidArgument):
        a.resized(8192)  # would cut the second block
    small = a.resized(16384)
    assert (small.capacity, small.used) == (16384, a.used)
    assert not small.allocate_at(0, 64) and not small.allocate_at(4096, 64)  # still taken
    assert small.allocate(16384 - 14144) is not None and small.allocate(64) is None
    big = a.resized(2 << 20)
    assert big.largest_free() == (2 << 20) - 14144 and big.fragments() == 1
    big.free(y, 10_000)
    big.free(x, 4096)
    assert big.used == 0 and big.fragments() == 1
