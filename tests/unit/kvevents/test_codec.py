"""Decoding vLLM KV event batches in both encodings, plus framing helpers."""

import msgspec
import pytest

from kvplane import kvevents
from kvplane.common.errors import ProtocolError
from kvplane.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Tier,
    decode_batch,
    decode_seq,
    extra_keys_of,
    tier_of,
    tokens_of,
)

pytestmark = pytest.mark.timeout(10)
BIG = 2**64 - 3


def test_map_encoding_is_vllms_exact_bytes():
    # vLLM writes the first seven BlockStored fields always (nil included), in this key order,
    # and omits trailing fields left at their default
    ev = kvevents.stored([5], [1, 2], 2, medium="GPU")
    want = {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None,
            "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU",
            "lora_name": None, "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    got = kvevents.encode_batch([ev, kvevents.removed([5])], dp_rank=0, ts=1.5)
    rm = {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU", "group_idx": 0}
    assert got == msgspec.msgpack.encode([1.5, [want, rm], 0])


def test_array_encoding_is_positional():
    # vLLM just before the map switch (PR #42892): every field, by position (msgspec writes
    # trailing defaults of array-like structs too)
    ev = kvevents.stored([5], [1], 1, parent=4, medium=None, encoding="array")
    got = kvevents.encode_batch([ev, kvevents.cleared("array")], dp_rank=None, ts=2.0)
    stored = ["BlockStored", [5], 4, [1], 1, None, None, None, None, None, None, None]
    assert got == msgspec.msgpack.encode([2.0, [stored, ["AllBlocksCleared"]], None])


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_both_encodings_decode_the_same(encoding):
    payload = kvevents.encode_batch([
        kvevents.stored([BIG, 7], list(range(8)), 4, parent=11, encoding=encoding, lora_name="L",
                     extra_keys=[("L",), ("L",)]),
        kvevents.removed([7], medium="CPU", encoding=encoding),
        kvevents.cleared(encoding),
    ], dp_rank=3, ts=12.5)
    b = decode_batch(payload)
    assert b.ts == 12.5 and b.dp_rank == 3
    st, rm, cl = b.events
    assert isinstance(st, BlockStored) and isinstance(rm, BlockRemoved) and isinstance(cl, AllBlocksCleared)
    assert st.hashes == [BIG, 7] and st.parent == 11 and st.block_size == 4 and st.lora_name == "L"
    assert tokens_of(st) == list(range(8)) and extra_keys_of(st) == [("L",), ("L",)]
    assert rm.hashes == [7] and tier_of(rm.medium) is Tier.CPU


def test_vllm_026_sample_shape_with_unknown_fields():
    # a map event with keys this decoder does not know (newer vLLM) and omitted defaults
    ev = {"type": "BlockStored", "block_hashes": [15760518052499183552], "parent_block_hash": None,
          "token_ids": list(range(16)), "block_size": 16, "lora_id": None, "medium": "GPU",
          "lora_name": None, "extra_keys": [None], "group_idx": 0,
          "kv_cache_spec_kind": "full_attention", "locality": "local", "session_id": "x"}
    b = decode_batch(msgspec.msgpack.encode([1789095808.83, [ev, {"type": "AllBlocksCleared"}], 0]))
    assert b.events[0].hashes == [15760518052499183552] and isinstance(b.events[1], AllBlocksCleared)
    assert extra_keys_of(b.events[0]) == [None]


def test_legacy_arrays_short_and_long():
    short = ["BlockStored", [1, 2], None, [0] * 8, 4, None]  # before `medium` existed
    long = ["BlockStored", [3], 2, [0] * 4, 4, None, "cpu", None, None, 0, "full", None, "extra"]
    b = decode_batch(msgspec.msgpack.encode([1.0, [short, long, ["BlockRemoved", [1], None]], 1]))
    assert b.events[0].hashes == [1, 2] and b.events[0].medium is None
    assert b.events[1].medium == "cpu" and b.events[1].parent == 2
    assert b.events[2].hashes == [1]


def test_map_batch_and_mixed_event_forms():
    events = [{"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"}, ["AllBlocksCleared"]]
    b = decode_batch(msgspec.msgpack.encode({"ts": 2.0, "events": events, "data_parallel_rank": None}))
    assert b.dp_rank is None and b.events[0].hashes == [5] and isinstance(b.events[1], AllBlocksCleared)


def test_hash_forms_bytes_and_signed():
    digest = bytes(range(32))
    ev = {"type": "BlockStored", "block_hashes": [digest, -1], "parent_block_hash": digest,
          "token_ids": [], "block_size": 4, "lora_id": None, "medium": None, "lora_name": None}
    b = decode_batch(msgspec.msgpack.encode([0.0, [ev], 0]))
    want = int.from_bytes(digest[-8:], "big")
    assert b.events[0].hashes == [want, 2**64 - 1] and b.events[0].parent == want


@pytest.mark.parametrize("payload", [
    b"", b"\xc1", msgspec.msgpack.encode("hello"), msgspec.msgpack.encode([1.0]),
    msgspec.msgpack.encode([1.0, [{"type": "Nope"}], 0]),
    msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}], 0]),
    msgspec.msgpack.encode([1.0, [["BlockStored", "not-a-list"]], 0]),
    msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [1.5]}], 0]),
], ids=["empty", "reserved-byte", "string", "short-batch", "unknown-tag", "missing-field",
        "wrong-type", "float-hash"])
def test_malformed_payloads_raise_protocol_error(payload):
    with pytest.raises(ProtocolError):
        decode_batch(payload)


def test_bad_token_ids_raise_protocol_error():
    ev = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
          "token_ids": ["x"], "block_size": 4, "lora_id": None, "medium": None, "lora_name": None}
    st = decode_batch(msgspec.msgpack.encode([0.0, [ev], 0])).events[0]
    with pytest.raises(ProtocolError):
        tokens_of(st)


@pytest.mark.parametrize("medium,tier", [(None, Tier.GPU), ("GPU", Tier.GPU), ("cuda", Tier.GPU),
                                         ("cpu", Tier.CPU), ("CPU", Tier.CPU), ("DRAM", Tier.CPU),
                                         ("disk", Tier.DISK), ("SSD", Tier.DISK), ("3fs", Tier.DISK),
                                         ("tape", None)])
def test_medium_to_tier(medium, tier):
    assert tier_of(medium) is tier


def test_decode_seq():
    assert decode_seq((5).to_bytes(8, "big")) == 5
    assert decode_seq(b"\xff" * 8) == -1
    with pytest.raises(ProtocolError):
        decode_seq(b"\x00" * 4)
