"""Manifest: chunk planning, hashing, validation of what a peer sends."""

import hashlib

import msgspec
import pytest

from kvplane.common.errors import InvalidArgument, ProtocolError
from kvplane.p2p import manifest as mf

pytestmark = pytest.mark.timeout(10)


def test_chunks_tile_each_item_and_never_straddle_two():
    plan = mf.plan_chunks([10, 0, 3, 8], 4)
    assert plan == [(0, 0, 4), (0, 4, 4), (0, 8, 2), (2, 0, 3), (3, 0, 4), (3, 4, 4)]


@pytest.mark.parametrize("bad", [0, -1])
def test_chunk_size_must_be_positive(bad):
    with pytest.raises(InvalidArgument):
        mf.plan_chunks([1], bad)


def test_build_round_trips_and_records_shapes_and_dtypes():
    items = [mf.Item("w", 12, "float32", [3]), mf.Item("b", 5)]
    digests = [mf.digest(bytes([i]) * n) for i, (_, _, n) in enumerate(mf.plan_chunks([12, 5], 8))]
    m = mf.build("model/a", 3, items, 8, digests)
    back = mf.decode(mf.encode(m))
    assert back == m and back.total_size == 17 and back.items[0].shape == [3]
    assert back.items[0].dtype == "float32" and len(back.chunks) == 3
    assert back.with_version(4).version == 4


def test_digest_is_sha256_of_the_bytes():
    assert mf.digest(b"abc") == hashlib.sha256(b"abc").hexdigest()
    with pytest.raises(InvalidArgument):
        mf.digest(b"abc", "md5")


def good():
    return mf.build("x", 1, [mf.Item("a", 10)], 4, [mf.digest(b"")] * 3)


@pytest.mark.parametrize("change", [
    {"name": "../etc"}, {"name": "with space"}, {"version": -1}, {"chunk_size": 0},
    {"hash": "md5"}, {"items": [mf.Item("a", 10), mf.Item("a", 0)]},
    {"chunks": []}, {"chunks": [mf.Chunk(0, 0, 4, "0" * 64)] * 3},
    {"items": [mf.Item("a", 11)]}, {"items": [mf.Item("a", 10, shape=[-1])]},
])
def test_validate_rejects_inconsistent_manifests(change):
    bad = msgspec.structs.replace(good(), **change)
    with pytest.raises(InvalidArgument):
        mf.validate(bad)


def test_decode_rejects_malformed_json():
    with pytest.raises(ProtocolError):
        mf.decode(b'{"name": 1}')
    with pytest.raises(InvalidArgument):  # valid JSON, bad digest
        mf.decode(mf.encode(good()).replace(b'"' + mf.digest(b"").encode() + b'"', b'"ab"', 1))
