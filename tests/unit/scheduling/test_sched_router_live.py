"""The scheduling Router's live-use hooks: availability, abandon, engine-reported load,
colocated mode, instances added at run time."""

from __future__ import annotations

import pytest

from kvplane.common.errors import InvalidArgument, NotFound, Unavailable
from kvplane.conductor.scheduling import ClusterConfig, ModelConfig, PolicyConfig, Request, TimeModel
from kvplane.conductor.scheduling.policy import create_policy
from kvplane.conductor.scheduling.router import Router

pytestmark = pytest.mark.timeout(10)
FIT = ModelConfig(prefill_fit=(0.01, 1e-3, 0.0))  # 10 ms + 1 ms per token


class NoPrefixes:
    def match(self, hash_ids):
        return {}


def router(policy: str = "least-loaded", colocated: bool = True, n: int = 2) -> tuple[Router, list[float]]:
    now = [0.0]
    tm = TimeModel(FIT, ClusterConfig(block_tokens=4))
    names = [f"e{i}" for i in range(n)]
    r = Router(create_policy(policy, PolicyConfig(rejection="none"), tm), NoPrefixes(), names,
               names if colocated else [f"d{i}" for i in range(n)], 1000, 8,
               clock=lambda: now[0], colocated=colocated)
    return r, now


def req(rid: int, n: int = 100) -> Request:
    return Request(rid, 0.0, n, 4, ())


def test_prefill_fit_replaces_the_flop_model():
    tm = TimeModel(FIT, ClusterConfig())
    assert tm.prefill_s(100, 0) == pytest.approx(0.11) and tm.prefill_s(100, 60) == pytest.approx(0.05)
    with pytest.raises(InvalidArgument):
        ModelConfig(prefill_fit=(1.0, 2.0))


def test_colocated_decisions_decode_where_they_prefill_and_book_load():
    r, _ = router()
    d = r.route(req(1))
    assert d.prefill == d.decode
    p, dec = r.loads()
    busy = next(x for x in p if x.instance == d.prefill)
    assert busy.queued == 1 and busy.queue_s == pytest.approx(0.11)
    assert r.route(req(2)).prefill != d.prefill  # least-loaded goes to the idle one
    with pytest.raises(InvalidArgument):
        r.route(req(1))  # rid 1 is in flight


def test_unavailable_instances_are_not_offered_and_none_left_is_unavailable():
    r, _ = router("round-robin")
    r.set_available("e0", False)
    assert {r.route(req(i)).prefill for i in range(4)} == {"e1"}
    assert r.available() == (["e1"], ["e1"])
    assert r.route(req(9), exclude=["e0"]).prefill == "e1"
    with pytest.raises(Unavailable):
        r.route(req(10), exclude=["e1"])
    with pytest.raises(NotFound):
        r.set_available("nope", True)


def test_abandon_releases_booked_load_wherever_the_request_is():
    r, _ = router()
    r.route(req(1))
    assert r.abandon(1) and not r.abandon(1)
    p, dec = r.loads()
    assert all(x.queued == 0 and x.queue_s == 0 for x in p) and r.in_flight() == 0
    r.route(req(2))
    r.prefill_done(2)
    assert sum(x.running for x in r.loads()[1]) == 1
    r.abandon(2)
    assert sum(x.running for x in r.loads()[1]) == 0 and all(x.kv_tokens == 0 for x in r.loads()[1])
    with pytest.raises(NotFound):
        r.prefill_done(2)


def test_engine_reported_waiting_beyond_ours_counts_as_queue():
    r, _ = router()
    r.route(req(1))
    r.abandon(1)  # the mean work of one request is now known (0.11 s)
    r.observe("e0", waiting=3)
    p, _ = r.loads()
    assert next(x for x in p if x.instance == "e0").queue_s == pytest.approx(0.33)
    assert r.route(req(2)).prefill == "e1"
    r.observe("e0", waiting=0, kv_capacity=5000)
    assert next(x for x in r.loads()[1] if x.instance == "e0").kv_capacity == 5000


def test_decide_books_nothing_and_instances_can_join():
    r, _ = router(n=1)
    assert r.decide(req(1)).prefill == "e0" and r.in_flight() == 0
    r.add_instance("e9", prefill=True, decode=True)
    r.set_available("e0", False)
    assert r.decide(req(1)).prefill == "e9"
    with pytest.raises(InvalidArgument):
        r.add_instance("x", prefill=True, decode=False)  # colocated needs both roles
    empty = Router(create_policy("random", PolicyConfig(), TimeModel(FIT, ClusterConfig())),
                   NoPrefixes(), [], [], 1, 1)
    with pytest.raises(Unavailable):
        empty.route(req(1))


def test_pd_mode_keeps_decode_separate():
    r, _ = router(colocated=False)
    d = r.route(req(1))
    assert d.prefill.startswith("e") and d.decode.startswith("d")
    with pytest.raises(InvalidArgument):
        Router(create_policy("random", PolicyConfig(), TimeModel(FIT, ClusterConfig())),
               NoPrefixes(), ["a"], ["b"], 1, 1, colocated=True)


class PoolAndHolder:
    """e0 holds the whole prefix on its device; the shared pool holds it for everyone."""

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks

    def match(self, hash_ids):
        from kvplane.conductor.indexer import Match

        n = self.blocks
        return {"e0": Match(n, n, n, n), "e1": Match(n, 0, 0, n)}


def pooled_router() -> tuple[Router, list[float], TimeModel]:
    now = [0.0]
    tm = TimeModel(FIT, ClusterConfig(block_tokens=4))
    r = Router(create_policy("mooncake", PolicyConfig(rejection="none"), tm), PoolAndHolder(24),
               ["e0", "e1"], ["e0", "e1"], 100_000, 8, clock=lambda: now[0], colocated=True)
    return r, now, tm


def shared(rid: int) -> Request:
    return Request(rid, 0.0, 100, 4, tuple(range(25)))  # 24 blocks reused, 4 tokens computed


def test_an_instance_whose_prefill_is_past_its_predicted_end_is_not_idle():
    # seen live: the router booked a 0.11 s prefill, the loaded engine took 0.3-0.8 s, and every
    # request after the predicted end went to that busy holder (its queue looked empty) while
    # the other instance, one cheap pool load away, sat idle
    r, now, tm = pooled_router()
    work = tm.prefill_s(100, 96)
    load = tm.reuse_s(pool_blocks=24)
    assert 0 < load < 0.5 * work  # the pool load is cheaper than half a prefill
    assert r.route(shared(1)).prefill == "e0"  # the holder, free: no load needed
    now[0] += 3 * work  # no first token yet: the engine is slower than predicted
    assert next(p for p in r.loads()[0] if p.instance == "e0").queue_s == pytest.approx(0.5 * work)
    assert r.route(shared(2)).prefill == "e1"
    r.prefill_done(1)
    r.prefill_done(2)
    assert all(p.queue_s == 0 for p in r.loads()[0])


def test_booked_work_follows_the_measured_pace_of_the_engines():
    r, now, tm = pooled_router()
    predicted = tm.prefill_s(100, 96)
    assert r.slowdown == 1.0
    for rid in range(1, 40):  # every prefill takes 3x its estimate
        r.route(shared(rid))
        now[0] += 3 * predicted
        r.prefill_done(rid)
        r.decode_done(rid)
    assert r.slowdown == pytest.approx(3.0, rel=0.01)
    r.route(shared(99))
    assert max(p.queue_s for p in r.loads()[0]) == pytest.approx(3 * predicted, rel=0.01)
    for rid in range(100, 200):  # an engine far off the model: the ratio stays bounded
        r.route(shared(rid))
        now[0] += 1000 * predicted
        r.prefill_done(rid)
    assert r.slowdown == pytest.approx(20.0, rel=0.01)
    before = r.slowdown
    r.route(shared(300))
    now[0] += 50 * predicted
    r.abandon(300)  # failed before its first token: not a measurement
    assert r.slowdown == before
