"""Planner: rarest-first and least-loaded choices, upload slots, gold last, bans."""

import random

import pytest

from kvplane.common.errors import InvalidArgument
from kvplane.p2p.planner import choose, unavailable

pytestmark = pytest.mark.timeout(10)


def rng():
    return random.Random(7)


def test_rarest_takes_the_chunk_fewest_holders_have():
    holders = [{"g": 0, "a": 0, "b": 0}, {"g": 4}, {"g": 8, "a": 8}]
    out = choose([0, 1, 2], holders, {}, 1, strategy="rarest", gold={"g"}, rng=rng())
    assert out == [(1, "g", 4)]


def test_at_equal_load_a_replica_goes_before_the_publisher():
    holders = [{"g": 0, "a": 100}]
    assert choose([0], holders, {}, 1, gold={"g"}, rng=rng()) == [(0, "a", 100)]
    assert choose([0], holders, {"a": 1}, 1, gold={"g"}, rng=rng()) == [(0, "g", 0)]


def test_upload_slots_cap_each_holder_and_update_load():
    holders = [{"g": i} for i in range(10)]
    load = {}
    out = choose(list(range(10)), holders, load, 10, gold={"g"}, max_uploads=3, rng=rng())
    assert len(out) == 3 and load == {"g": 3}
    assert choose(list(range(10)), holders, load, 10, gold={"g"}, max_uploads=3, rng=rng()) == []


def test_least_loaded_spreads_over_holders():
    holders = [{"g": i, "a": i, "b": i} for i in range(6)]
    load = {}
    out = choose(list(range(6)), holders, load, 6, strategy="least-loaded", gold={"g"}, rng=rng())
    assert len(out) == 6 and len({c for c, _, _ in out}) == 6
    assert load == {"g": 2, "a": 2, "b": 2}


def test_publisher_baseline_uses_only_gold_without_a_slot_limit():
    holders = [{"g": i, "a": i} for i in range(8)]
    out = choose(list(range(8)), holders, {}, 8, strategy="publisher", gold={"g"}, max_uploads=1,
                 rng=rng())
    assert len(out) == 8 and {h for _, h, _ in out} == {"g"}


def test_banned_and_unusable_holders_are_skipped():
    holders = [{"g": 0, "a": 1}]
    assert choose([0], holders, {}, 1, gold={"g"}, banned={(0, "a")}, rng=rng()) == [(0, "g", 0)]
    assert choose([0], holders, {}, 1, gold={"g"}, usable={"g"}, rng=rng()) == [(0, "g", 0)]
    assert choose([0], holders, {}, 1, gold={"g"}, usable=set(), rng=rng()) == []


def test_unknown_strategy_and_unavailable_chunks():
    with pytest.raises(InvalidArgument):
        choose([0], [{"g": 0}], {}, 1, strategy="random")
    assert unavailable([0, 1], [{"g": 0}, {"dead": 0}], alive={"g"}) == [1]


def test_a_chunk_already_on_its_way_elsewhere_is_not_the_rarest():
    holders = [{"g": 0}, {"g": 4}]
    out = choose([0, 1], holders, {}, 1, gold={"g"}, pending={0: 1}, rng=rng())
    assert out == [(1, "g", 4)]
