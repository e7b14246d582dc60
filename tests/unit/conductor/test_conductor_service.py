"""The in-process Conductor API: registration rules, event application, queries, mismatches."""

import pytest

import kvplane.conductor as conductor_pkg
from kvplane import kvevents
from kvplane.common.errors import Conflict, InvalidArgument, NotFound
from kvplane.conductor.config import ConductorConfig
from kvplane.conductor.hashing import HashProfile
from kvplane.conductor.service import Conductor, QueryRequest, Registration, offset_endpoint
from kvplane.kvevents import decode_batch

pytestmark = pytest.mark.timeout(10)
BS = 4
TOKENS = list(range(1, 17))  # 4 complete blocks


def apply(c, stream, *events, seq=None):
    c.apply(stream, decode_batch(kvevents.encode_batch(list(events), stream.dp_rank)), seq)


def stored(profile, tokens, **kw):
    return kvevents.stored(list(profile.event_hashes(tokens, BS)), tokens, BS, **kw)


@pytest.fixture
def c():
    return Conductor(ConductorConfig())


def test_public_surface_is_pinned():
    assert sorted(conductor_pkg.__all__) == sorted([
        "DEFAULT_PORT", "Conductor", "ConductorConfig", "ContextKey", "HashProfile", "Holder",
        "Match", "PrefixIndex", "QueryRequest", "Registration", "Tier"])


def test_query_by_tokens_and_by_hash_agree(c):
    (s,) = c.register(Registration("a", "m", BS))
    p = HashProfile()
    apply(c, s, stored(p, TOKENS[:12]))
    by_tok = c.query(QueryRequest("m", token_ids=TOKENS + [99], block_size=BS))
    by_hash = c.query(QueryRequest("m", seq_hashes=list(p.event_hashes(TOKENS, BS))))
    want = {"default": {"a": {"longest_matched": 12, "GPU": 12, "CPU": 12, "DISK": 12, "DP": {"0": 12}}}}
    assert by_tok == by_hash == want


def test_lora_and_cache_salt_change_the_chain(c):
    (s,) = c.register(Registration("a", "m", BS))
    p = HashProfile()
    hs = list(p.event_hashes(TOKENS, BS, lora_name="L", cache_salt="salt"))
    apply(c, s, kvevents.stored(hs, TOKENS, BS, lora_name="L"))
    q = QueryRequest("m", token_ids=TOKENS, lora_name="L", cache_salt="salt")
    assert c.query(q)["default"]["a"]["GPU"] == 16
    q.cache_salt = None
    assert c.query(q)["default"]["a"]["GPU"] == 0
    assert c.query(QueryRequest("m", token_ids=TOKENS))["default"]["a"]["GPU"] == 0  # base model


def test_removed_and_cleared_events(c):
    (s,) = c.register(Registration("a", "m", BS))
    p = HashProfile()
    hs = list(p.event_hashes(TOKENS, BS))
    apply(c, s, stored(p, TOKENS), kvevents.removed([hs[2]]))
    assert c.query(QueryRequest("m", token_ids=TOKENS))["default"]["a"]["GPU"] == 8
    apply(c, s, kvevents.cleared())
    assert c.query(QueryRequest("m", token_ids=TOKENS))["default"]["a"]["longest_matched"] == 0


def test_cpu_medium_from_offload_connector(c):
    (s,) = c.register(Registration("a", "m", BS))
    p = HashProfile()
    apply(c, s, stored(p, TOKENS[:4]), stored(p, TOKENS, medium="cpu"))
    r = c.query(QueryRequest("m", token_ids=TOKENS))["default"]["a"]
    assert (r["GPU"], r["CPU"], r["DISK"], r["longest_matched"]) == (4, 16, 16, 16)


def test_shared_store_pool_shows_up_as_a_tier_for_all(c):
    (a,) = c.register(Registration("a", "m", BS))
    c.register(Registration("b", "m", BS))
    (pool,) = c.register(Registration("kv-store", "m", BS, type="kvplane"))
    p = HashProfile()
    apply(c, a, stored(p, TOKENS[:4]))
    apply(c, pool, stored(p, TOKENS[:12], medium="cpu"), stored(p, TOKENS, medium="disk"))
    r = c.query(QueryRequest("m", token_ids=TOKENS))["default"]
    assert set(r) == {"a", "b"}
    assert (r["a"]["GPU"], r["a"]["CPU"], r["a"]["DISK"]) == (4, 12, 16)
    assert (r["b"]["GPU"], r["b"]["CPU"], r["b"]["DISK"]) == (0, 12, 16)


def test_dp_ranks_and_endpoint_offsets(c):
    streams = c.register(Registration("a", "m", BS, endpoint="tcp://127.0.0.1:5557",
                                      replay_endpoint="tcp://127.0.0.1:6000", dp_size=2))
    assert [s.endpoint for s in streams] == ["tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"]
    assert streams[1].replay_endpoint == "tcp://127.0.0.1:6001"
    assert offset_endpoint("ipc:///tmp/x", 1) == "ipc:///tmp/x_dp1"
    p = HashProfile()
    apply(c, streams[1], stored(p, TOKENS[:8]))
    r = c.query(QueryRequest("m", token_ids=TOKENS))["default"]["a"]
    assert r["DP"] == {"0": 0, "1": 8} and r["GPU"] == 8


def test_register_idempotent_conflicts_and_unregister(c):
    reg = Registration("a", "m", BS)
    c.register(reg)
    c.register(reg)
    assert len(c.streams()) == 1
    with pytest.raises(Conflict):
        c.register(Registration("a", "m", BS, topic="other"))
    with pytest.raises(Conflict):  # same context, different hash profile: reported, not silent
        c.register(Registration("b", "m", BS, hash_profile=HashProfile("sha256_cbor")))
    assert c.unregister("a") == ["a|default|0"]
    with pytest.raises(NotFound):
        c.unregister("a")
    c.register(Registration("b", "m", BS, hash_profile=HashProfile("sha256_cbor")))  # context free again


def test_event_hash_mismatch_is_reported(c):
    (s,) = c.register(Registration("a", "m", BS))  # conductor assumes sha256, seed "0"
    wrong = HashProfile("sha256", "1")
    apply(c, s, stored(wrong, TOKENS))
    assert s.hash_status == "mismatch"
    h = c.health()
    assert h["status"] == "degraded" and h["mismatched_streams"] == ["a|default|0"]
    assert c.instances()[0]["hash_status"] == "mismatch"
    (t,) = c.register(Registration("b", "m", BS))
    apply(c, t, stored(HashProfile(), TOKENS))
    assert t.hash_status == "ok" and t.hash_checks == 1


def test_block_size_mismatch_is_counted_and_skipped(c):
    (s,) = c.register(Registration("a", "m", BS))
    apply(c, s, kvevents.stored([1, 2], list(range(16)), 8))
    assert s.block_size_mismatches == 1 and c.health()["blocks"] == 0


def test_query_validation(c):
    c.register(Registration("a", "m", BS))
    c.register(Registration("b", "m2", 8))
    c.register(Registration("c", "m2", 16))
    with pytest.raises(InvalidArgument):
        c.query(QueryRequest("m"))
    with pytest.raises(InvalidArgument):
        c.query(QueryRequest("m", token_ids=[1], seq_hashes=[1]))
    with pytest.raises(InvalidArgument):  # ambiguous block size
        c.query(QueryRequest("m2", token_ids=TOKENS))
    with pytest.raises(NotFound):
        c.query(QueryRequest("m", token_ids=TOKENS, instance_id="zzz"))
    assert c.query(QueryRequest("m", token_ids=TOKENS, instance_id="a"))["default"]["a"]["GPU"] == 0
    assert c.query(QueryRequest("unknown", token_ids=TOKENS, block_size=4)) == {"default": {}}
    small = Conductor(ConductorConfig(max_query_tokens=8))
    small.register(Registration("a", "m", BS))
    with pytest.raises(InvalidArgument):
        small.query(QueryRequest("m", token_ids=TOKENS))
    with pytest.raises(InvalidArgument):
        small.query(QueryRequest("m", seq_hashes=[1, 2, 3]))


def test_random_seed_profile_allows_hash_queries_only(c):
    (s,) = c.register(Registration("a", "m", BS, hash_profile=HashProfile(seed="random")))
    apply(c, s, kvevents.stored([7, 8], TOKENS[:8], BS))
    assert c.query(QueryRequest("m", seq_hashes=[7, 8]))["default"]["a"]["GPU"] == 8
    with pytest.raises(InvalidArgument):
        c.query(QueryRequest("m", token_ids=TOKENS))


def test_unregister_forgets_blocks_and_late_batches(c):
    (s,) = c.register(Registration("a", "m", BS))
    p = HashProfile()
    apply(c, s, stored(p, TOKENS))
    c.unregister("a")
    apply(c, s, stored(p, TOKENS))  # a batch racing the unregister is dropped
    assert c.health()["blocks"] == 0


def test_registration_validation():
    for bad in (dict(block_size=0), dict(dp_size=0), dict(endpoint="http://x")):
        with pytest.raises(InvalidArgument):
            Registration("a", "m", **{"block_size": BS, **bad})
    with pytest.raises(InvalidArgument):
        Registration("", "m", BS)


def test_wait_until_predicate_may_call_locked_views(c):
    # regression: a predicate calling health() while wait_until holds the condition deadlocked
    assert c.wait_until(lambda: c.health()["blocks"] == 0, 1.0)
    assert not c.wait_until(lambda: c.health()["blocks"] == 1, 0.05)
