"""Split keyed requests by shard and join the answers as one master would have given them."""

from kvplane.store.shard.merge import merge, part
from kvplane.store.types import (
    CodesRep,
    Columns,
    KeyResult,
    KeysReq,
    Location,
    PutStartReq,
    Replica,
    ReplicateConfig,
    ResultsRep,
    column_results,
)


def res(addr, seg="s"):
    return KeyResult(0, [Replica(seg, addr, 10, "", "", addr)], 10)


def test_a_part_cuts_every_per_key_list_and_keeps_the_rest():
    req = PutStartReq("c", ["a", "b", "c"], [1, 2, 3], ReplicateConfig(), checksums=[7, 8, 9],
                      nonce=5, retired=[("s", 1)])
    cut = part(req, "put_start", [2, 0])
    assert (cut.keys, cut.sizes, cut.checksums) == (["c", "a"], [3, 1], [9, 7])
    assert cut.nonce == 5 and cut.retired == [("s", 1)]
    none = part(KeysReq("c", ["a", "b"]), "get_replicas", [1])
    assert none.keys == ["b"] and none.expect is None
    exp = part(KeysReq("c", ["a", "b"], expect=[None, Location("s", 1, 2, 3)]),
               "get_replicas", [1])
    assert exp.expect == [Location("s", 1, 2, 3)]


def test_codes_come_back_in_the_callers_order_with_retire_indexes_renumbered():
    got = merge(4, [([1, 3], CodesRep([11, 13], retire=[(1, "s", 9)])),
                    ([0, 2], CodesRep([10, 12], grants=[("s", b"g")]))])
    assert got.codes == [10, 11, 12, 13]
    assert got.retire == [(3, "s", 9)] and got.grants == [("s", b"g")]


def test_lookups_with_expectations_list_the_stale_keys_in_order():
    a = ResultsRep([res(1)], 10.0, stale=[1])  # shard a: its keys 0, 2 -> its second is stale
    b = ResultsRep([res(2)], 8.0, stale=[0])  # shard b: keys 1, 3 -> its first is stale
    got = merge(4, [([0, 2], a), ([1, 3], b)])
    assert got.stale == [1, 2] and [r.replicas[0].addr for r in got.results] == [2, 1]
    assert got.ttl == 8.0


def test_columns_join_when_every_shard_sent_them_else_become_results():
    ca = Columns(["x", "y"], [1, 0], [100, 200], [10, 10], [5, 6])
    cb = Columns(["y"], [0], [300], [10], [7])
    got = merge(3, [([2, 0], ResultsRep([], 5, columns=ca)), ([1], ResultsRep([], 5, columns=cb))])
    rows = column_results(got.columns)
    assert [(r.replicas[0].segment, r.replicas[0].addr) for r in rows] == \
        [("x", 200), ("y", 300), ("y", 100)]
    mixed = merge(2, [([0], ResultsRep([], 5, columns=cb)), ([1], ResultsRep([res(4)], 5))])
    assert mixed.columns is None and [r.replicas[0].addr for r in mixed.results] == [300, 4]
