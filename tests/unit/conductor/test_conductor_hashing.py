"""vLLM block hashing against the golden vectors of docs/reference.md §R1."""

import hashlib
import pickle

import numpy as np
import pytest

from kvplane.common.errors import InvalidArgument
from kvplane.conductor.hashing import HashProfile, cbor_canonical, low64
from kvplane.kvevents import to_event_hash
from kvplane.testing.needs import requires

pytestmark = pytest.mark.timeout(10)

TOKENS = [1, 2, 3, 4, 5, 6, 7, 8]
GOLDEN = {
    "sha256": ("1973e23848344dc43a988a9b478663803cfffe1243480253f9a3cf004b14aa7c",
               [("762b2e7e", "23bae91d", 10362225831949560093),
                ("9e62b5a7", "2a2b036b", 12472515041799373675)]),
    "sha256_cbor": ("4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e",
                    [("c9d58ba6", "8ef071cb", 2164874634404590027),
                     ("24125b23", "154ab2d6", 17270480062156288726)]),
}


@pytest.mark.parametrize("algo", sorted(GOLDEN))
def test_golden_vectors(algo):
    none_hex, blocks = GOLDEN[algo]
    p = HashProfile(algo, "0")
    assert p.none_hash.hex() == none_hex
    digests = list(p.digests(TOKENS, 4))
    assert len(digests) == 2
    for d, (head, tail, event_int) in zip(digests, blocks):
        assert d.hex().startswith(head) and d.hex().endswith(tail)
        assert low64(d) == event_int
    assert list(p.event_hashes(TOKENS, 4)) == [b[2] for b in blocks]


def test_extra_keys_golden_lora_and_salt():
    p = HashProfile("sha256", "0")
    assert list(p.event_hashes(TOKENS[:4], 4, extra_keys=[("adapter-A", "tenant-salt")])) \
        == [602575766154556200]
    # the same keys built from a LoRA name (every block) and a cache salt (first block only)
    assert list(p.event_hashes(TOKENS[:4], 4, lora_name="adapter-A", cache_salt="tenant-salt")) \
        == [602575766154556200]


def test_salt_only_first_block_lora_every_block():
    p = HashProfile()
    plain = list(p.digests(TOKENS, 4))
    salted = list(p.digests(TOKENS, 4, cache_salt="s"))
    assert salted[0] != plain[0]
    # block 1 differs only through its parent; recompute it from the salted parent with no extras
    assert salted[1] == p.hash_block(salted[0], TOKENS[4:], None)
    lora = list(p.digests(TOKENS, 4, lora_name="L"))
    assert lora[1] == p.hash_block(lora[0], TOKENS[4:], ("L",))


def test_chain_uses_full_digest_not_projection():
    p = HashProfile()
    d0, d1 = p.digests(TOKENS, 4)
    wrong = p.hash_block(low64(d0).to_bytes(8, "big"), TOKENS[4:])
    assert wrong != d1 and p.hash_block(d0, TOKENS[4:]) == d1


def test_partial_block_ignored_and_lazy():
    p = HashProfile()
    assert len(list(p.digests(TOKENS + [9, 10, 11], 4))) == 2
    it = p.digests(list(range(4000)), 4)
    first = next(it)  # lazy: one block hashed, generator still open
    assert first == p.hash_block(None, [0, 1, 2, 3])


def test_seed_changes_root():
    assert HashProfile("sha256", "0").none_hash != HashProfile("sha256", "1").none_hash
    assert HashProfile("sha256", "0").none_hash == hashlib.sha256(pickle.dumps("0", protocol=5)).digest()
    assert not HashProfile(seed="random").reproducible


def test_profile_validation():
    with pytest.raises(InvalidArgument):
        HashProfile("xxhash")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        HashProfile(seed=0)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        list(HashProfile().digests([1], 0))


def test_cbor_canonical_encodings():
    assert cbor_canonical(0) == b"\x00"
    assert cbor_canonical(23) == b"\x17"
    assert cbor_canonical(24) == b"\x18\x18"
    assert cbor_canonical(1000) == b"\x19\x03\xe8"
    assert cbor_canonical(1_000_000) == b"\x1a\x00\x0f\x42\x40"
    assert cbor_canonical(2**32) == b"\x1b\x00\x00\x00\x01\x00\x00\x00\x00"
    assert cbor_canonical(-1) == b"\x20" and cbor_canonical(-500) == b"\x39\x01\xf3"
    assert cbor_canonical(None) == b"\xf6" and cbor_canonical(True) == b"\xf5"
    assert cbor_canonical("a") == b"\x61a" and cbor_canonical(b"\x01") == b"\x41\x01"
    assert cbor_canonical((1, [2, 3])) == b"\x82\x01\x82\x02\x03"
    with pytest.raises(InvalidArgument):
        cbor_canonical(1.5)
    with pytest.raises(InvalidArgument):
        cbor_canonical(2**64)


def test_event_hash_normalisation():
    assert to_event_hash(5) == 5
    assert to_event_hash(-1) == 2**64 - 1
    digest = bytes(range(32))
    assert to_event_hash(digest) == int.from_bytes(digest[-8:], "big")


@pytest.mark.parametrize("block", [(1, 2, 3), (0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1),
                                   (2**32, 5), (-1, 5), (True, 1), ()])
def test_cbor_token_fast_path_matches_generic_encoder(block):
    from kvplane.conductor.hashing import _sha256_cbor
    obj = (b"\x07" * 32, block, ("lora", ("mm", 3)))
    assert _sha256_cbor(obj) == hashlib.sha256(cbor_canonical(obj)).digest()


def test_tagged_strategy_matches_vllm_032_extra_keys():
    # vLLM 0.32 hashes ("lora", name, path) on every block and ("cache_salt", salt) on block 0
    p = HashProfile(strategy="vllm_v1_tagged")
    got = list(p.digests(TOKENS, 4, lora_name="A", lora_path="/p", cache_salt="s"))
    assert got[0] == p.hash_block(None, TOKENS[:4], (("lora", "A", "/p"), ("cache_salt", "s")))
    assert got[1] == p.hash_block(got[0], TOKENS[4:], (("lora", "A", "/p"),))
    untagged = list(HashProfile().digests(TOKENS, 4, lora_name="A", cache_salt="s"))
    assert got[0] != untagged[0]
    # without LoRA or salt both strategies agree (and match the golden vectors)
    assert list(p.event_hashes(TOKENS, 4)) == [10362225831949560093, 12472515041799373675]


def _reference(p, tokens, bs, salt=None):
    """Block by block through the generic encoders (the path the golden vectors pin)."""
    out, parent = [], None
    for i in range(len(tokens) // bs):
        extra = (salt,) if salt and i == 0 else None
        parent = p.hash_block(parent, [int(t) for t in tokens[i * bs:(i + 1) * bs]], extra)
        out.append(parent)
    return out


@pytest.fixture(params=["native", "numpy"])
def chain_path(request, monkeypatch):
    """Run a test on the C accelerator's chain and again on the numpy layout."""
    from kvplane.conductor import hashing
    if request.param == "native":
        requires("accel")
    if request.param == "numpy":
        monkeypatch.setattr(hashing, "native", None)
    return request.param


@pytest.mark.parametrize("algo", sorted(GOLDEN))
@pytest.mark.parametrize("bs", [1, 2, 3, 4, 5, 16, 23, 24, 255, 256])
def test_batched_path_matches_block_by_block(algo, bs, chain_path):
    """Every token size class of both encodings, every tuple/array head, across batch edges."""
    import random

    from kvplane.conductor import hashing
    rng = random.Random(bs)
    classes = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**31 - 1]
    n = (hashing._FIRST_BATCH + hashing._FIRST_BATCH * hashing._BATCH_GROWTH + 3) * bs + bs // 2
    tokens = [rng.choice(classes) if rng.random() < 0.3 else rng.randrange(1 << 17) for _ in range(n)]
    p = HashProfile(algo)
    want = _reference(p, tokens, bs)
    assert list(p.digests(tokens, bs)) == want
    assert list(p.digests(np.array(tokens, dtype=np.int64), bs)) == want
    assert list(p.digests([np.int32(t) for t in tokens[:9 * bs]], bs)) == want[:9]
    assert list(p.event_hashes(tuple(tokens), bs)) == [low64(d) for d in want]
    assert list(p.digests(tokens, bs, cache_salt="s")) == _reference(p, tokens, bs, "s")
    batches = [len(b) for b in p.digest_batches(tokens, bs)]
    assert batches[:2] == [hashing._FIRST_BATCH, hashing._FIRST_BATCH * hashing._BATCH_GROWTH]


@pytest.mark.parametrize("algo", sorted(GOLDEN))
def test_batched_path_falls_back_where_it_does_not_apply(algo, monkeypatch, chain_path):
    from kvplane.conductor import hashing
    p = HashProfile(algo)
    big = [2**31 + 5, 7] * 40  # LONG1 for pickle, a u32 for CBOR
    assert list(p.digests(big, 4)) == _reference(p, big, 4)
    wide = list(range(70000, 70000 + 2 * 13200))  # one block's pickle: more than a 64 KiB frame
    assert list(p.digests(wide, 13200)) == _reference(p, wide, 13200)
    layout = hashing._layout(np.array(wide, np.int64), 13200, algo == "sha256_cbor")
    assert (layout is None) == (algo == "sha256")  # CBOR has no frames
    # a layout that stops matching the generic encoder is caught on a batch's first block
    monkeypatch.setattr(hashing, "_PICKLE_OPS", np.array([0x4B, 0x4D, 0x4B], np.uint8))
    monkeypatch.setattr(hashing, "_CBOR_USED", hashing._CBOR_USED[[0, 1, 1, 3]])
    odd = [70000 if algo == "sha256" else 300] * 16 * 10
    assert hashing._fast_chain(algo, np.array(odd, np.int64), 16, p.none_hash, use_native=False) is None
    assert list(p.digests(odd, 16)) == _reference(p, odd, 16)
    with pytest.raises(TypeError):
        list(p.digests([1.5] * 64, 4))


@pytest.mark.parametrize("algo", sorted(GOLDEN))
def test_native_chain_that_goes_wrong_is_caught_on_the_first_block(algo, monkeypatch):
    from kvplane.conductor import hashing
    requires("accel")
    p, bs = HashProfile(algo), 16
    tokens = list(range(1000, 1000 + bs * 100))
    real = hashing.native

    class Broken:  # a chain one bit off in its first digest
        parse_ids = staticmethod(real.parse_ids)

        @staticmethod
        def chain(*args):
            blob = real.chain(*args)
            return bytes([blob[0] ^ 1]) + blob[1:]
    monkeypatch.setattr(hashing, "native", Broken)
    assert list(p.digests(tokens, bs)) == _reference(p, tokens, bs)  # the numpy path answered
    calls = []
    monkeypatch.setattr(hashing, "_layout", lambda *a: calls.append(a))  # and nothing else is left
    assert hashing._fast_chain(algo, np.array(tokens, np.int64), bs, p.none_hash) is None and calls


@pytest.mark.parametrize("algo", sorted(GOLDEN))
def test_prefix_cache_is_exact_and_reused_by_a_longer_prompt(algo):
    import random

    from kvplane.conductor import hashing
    rng = random.Random(9)
    p, bs = HashProfile(algo), 16
    turn1 = [rng.randrange(50_000) for _ in range(bs * 300 + 5)]
    turn2 = turn1[:bs * 200] + [rng.randrange(50_000) for _ in range(bs * 150)]  # shares 200 blocks
    want1, want2 = _reference(p, turn1, bs), _reference(p, turn2, bs)
    assert list(p.digests(turn1, bs)) == want1  # cold: fills the cache
    filled = len(p._chunks)
    assert filled == (300 - hashing._FIRST_BATCH) // hashing.CHUNK_BLOCKS + 1
    assert list(p.digests(turn1, bs)) == want1  # warm: the same chain from the cache
    assert list(p.digests(turn2, bs)) == want2  # shares whole chunks, then diverges
    other = HashProfile(algo)
    assert list(other.digests(turn1[:bs * 150], 8)) == _reference(other, turn1[:bs * 150], 8)
    assert list(p.digests(turn1[:bs * 150], 8)) == _reference(p, turn1[:bs * 150], 8)  # other block size
    p.clear_cache()
    assert not p._chunks and list(p.digests(turn2, bs)) == want2


def test_prefix_cache_is_bounded(monkeypatch):
    from kvplane.conductor import hashing
    monkeypatch.setattr(hashing, "CACHE_CHUNKS", 3)
    p = HashProfile()
    for seed in range(4):
        toks = [(seed * 7919 + i) % 30_000 for i in range(16 * 64 * 4)]
        assert list(p.digests(toks, 16)) == _reference(p, toks, 16)
        assert len(p._chunks) <= 3
