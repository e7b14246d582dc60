"""The live router: the same policy objects, prefix matches from a real Conductor, load bookkeeping."""

import pytest

import kvplane.conductor.scheduling as sched_pkg
from kvplane import kvevents
from kvplane.common.errors import InvalidArgument, NotFound
from kvplane.conductor.config import ConductorConfig
from kvplane.conductor.hashing import HashProfile
from kvplane.conductor.scheduling.config import ClusterConfig, ModelConfig, PolicyConfig
from kvplane.conductor.scheduling.policy import create_policy
from kvplane.conductor.scheduling.prefix import ConductorPrefixes
from kvplane.conductor.scheduling.router import Router
from kvplane.conductor.scheduling.timemodel import TimeModel
from kvplane.conductor.scheduling.view import Request
from kvplane.conductor.service import Conductor, Registration
from kvplane.kvevents import decode_batch

pytestmark = pytest.mark.timeout(10)
BS = 16
TOKENS = list(range(1, 16 * 40 + 1))  # 40 blocks


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


@pytest.fixture
def setup():
    c = Conductor(ConductorConfig())
    streams = {i: c.register(Registration(i, "m", BS))[0] for i in ("p0", "p1")}
    hashes = list(HashProfile().event_hashes(TOKENS, BS))
    batch = kvevents.encode_batch([kvevents.stored(hashes, TOKENS, BS)], 0)
    c.apply(streams["p1"], decode_batch(batch))
    tm = TimeModel(ModelConfig(), ClusterConfig(block_tokens=BS))
    clock = Clock()

    def make(name, **knobs):
        pol = create_policy(name, PolicyConfig(**knobs), tm, seed=5)
        return Router(pol, ConductorPrefixes(c, "m", BS, ["p0", "p1"]), ["p0", "p1"], ["d0", "d1"],
                      kv_capacity=100_000, max_batch=8, clock=clock)

    return make, hashes, clock


def test_public_surface_is_pinned():
    assert sorted(sched_pkg.__all__) == sorted([
        "POLICIES", "ClusterConfig", "ClusterView", "Decision", "DecodeLoad", "ModelConfig",
        "PolicyConfig", "PrefillLoad", "PrefixSource", "Request", "SchedulingPolicy", "SimConfig",
        "SloConfig", "TimeModel", "create_policy"])


def test_mooncake_routes_to_the_instance_the_conductor_says_holds_the_prefix(setup):
    make, hashes, _ = setup
    router = make("mooncake")
    d = router.route(Request(1, 0.0, len(TOKENS) + 5, 50, tuple(hashes) + (12345,)))
    assert d.prefill == "p1" and d.prefix_blocks == 40 and d.source is None


def test_bookkeeping_moves_load_from_prefill_to_decode_and_back(setup):
    make, hashes, clock = setup
    router = make("least-loaded")
    a = router.route(Request(1, 0.0, 8000, 50, (1, 2, 3)))
    b = router.route(Request(2, 0.0, 8000, 50, (4, 5, 6)))
    assert {a.prefill, b.prefill} == {"p0", "p1"}  # the second sees the first one's queue
    pre, dec = router.loads()
    assert all(p.queued == 1 and p.queue_s > 0 for p in pre)
    assert sum(len(d.incoming) for d in dec) == 2
    clock.t += 5
    router.prefill_done(1)
    pre, dec = router.loads()
    assert sum(p.queued for p in pre) == 1 and sum(d.running for d in dec) == 1
    router.decode_done(1)
    pre, dec = router.loads()
    assert sum(d.running for d in dec) == 0 and sum(d.kv_tokens for d in dec) == 0
    with pytest.raises(NotFound):
        router.decode_done(1)
    with pytest.raises(NotFound):
        router.prefill_done(99)


def test_rejections_are_counted(setup):
    make, _, _ = setup
    router = make("mooncake", ttft_slo_s=0.001)
    d = router.route(Request(1, 0.0, 100_000, 50, (1,)))
    assert d.rejected and router.rejected == 1


def test_conductor_errors_degrade_to_no_prefix():
    src = ConductorPrefixes(Conductor(ConductorConfig()), "unknown-model", BS, ["p0"])
    got = src.match([1, 2, 3])
    assert got["p0"].longest == 0 and src.errors == 0  # no instances: empty answer
    bad = ConductorPrefixes(Conductor(ConductorConfig()), "m", -1, ["p0"])
    assert bad.match([1])["p0"].longest == 0 and bad.errors == 1


def test_router_needs_instances(setup):
    tm = TimeModel(ModelConfig(), ClusterConfig())
    with pytest.raises(InvalidArgument):
        Router(create_policy("random", PolicyConfig(), tm), None, [], ["d0"], 1, 1)


def test_cache_blind_policy_still_books_cached_work_from_the_index(setup):
    make, hashes, _ = setup
    router = make("round-robin")
    router.route(Request(1, 0.0, len(TOKENS), 50, tuple(hashes)))  # -> p0, nothing cached there
    router.route(Request(2, 0.0, len(TOKENS), 50, tuple(hashes)))  # -> p1, which holds all 40 blocks
    pre, _ = router.loads()
    by = {p.instance: p for p in pre}
    assert by["p1"].queue_s < by["p0"].queue_s / 5 and by["p1"].queued_tokens == 1
