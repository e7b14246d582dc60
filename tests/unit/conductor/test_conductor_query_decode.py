"""The JSON query decoder: the C id parser must agree with msgspec on every body, error or not."""

import dataclasses

import msgspec
import numpy as np
import pytest
from fastapi.exceptions import RequestValidationError

from kvplane.conductor import api
from kvplane.testing.needs import requires

pytestmark = pytest.mark.timeout(10)

IDS = [
    "[1,2,3]", " [ 1 ,\n2\t, 3 ] ", "[]", "null", "[0]", "[4294967295]", "[4294967296]", "[-1]",
    "[1.0]", "[1e3]", "[01]", "[00]", "[1,]", "[,1]", "[1 2]", '["1"]', "[true]", "[null]",
    "[" + "9" * 30 + "]", "[1", "1", "{}", "[[1]]", "[18446744073709551616]", "[ ]", "[-0]",
]


def _decode(text: str, monkeypatch, native: bool) -> object:
    body = ('{"model": "m", "block_size": 4, "token_ids": ' + text + "}").encode()
    return _decode_body(body, monkeypatch, native)


def _decode_body(body: bytes, monkeypatch, native: bool) -> object:
    """("ok", ids and every other field) or ("error", the 422 details), with or without C."""
    if not native:
        monkeypatch.setattr(api, "native", None)
    try:
        req = api._decode_query(body, "application/json", by_hash=False)
    except RequestValidationError as exc:
        return ("error", exc.errors())
    finally:
        monkeypatch.undo()
    ids = req.token_ids
    rest = {k: v for k, v in dataclasses.asdict(req).items() if k != "token_ids"}
    return ("ok", None if ids is None else [int(t) for t in ids], rest)


@pytest.mark.requires("accel")
@pytest.mark.parametrize("text", IDS)
def test_c_parser_agrees_with_msgspec(text, monkeypatch):
    got, want = _decode(text, monkeypatch, True), _decode(text, monkeypatch, False)
    assert got == want
    if text.strip().startswith("[") and want[0] == "ok":
        assert want[1] == msgspec.json.decode(text.encode())


# Whole bodies around the ids: other members before and after, nested values, strings holding
# brackets, quotes and the key's own name, escaped keys, a key given twice, syntax errors.
BODIES = [
    b'{"token_ids": [5, 6], "model": "m"}',
    b'{"model": "m", "token_ids": [5, 6], "block_size": 2}',
    b' {\n"model":"m" ,\t"token_ids" : [5,6] } \n',
    b'{"model": "m]}\\"token_ids\": [9]", "token_ids": [5, 6]}',
    b'{"model": "m", "cache_salt": "{\\"token_ids\\": [1]}", "token_ids": [7]}',
    b'{"model": "m", "lora_name": null, "seq_hashes": [1, [2]], "token_ids": [7]}',
    b'{"model": "m", "extra": {"token_ids": [1, 2], "x": [[], {}]}, "token_ids": [3]}',
    b'{"model": "m", "token_ids": [1], "token_ids": [2]}',
    b'{"model": "m", "token_\\u0069ds": [1]}',
    b'{"model": "m", "token_ids": [1], "token_\\u0069ds": [2]}',
    b'{"mod\\u0065l": "m", "token_ids": [1]}',
    b'{"model": "m", "token_ids": [1]} x',
    b'{"model": "m", "token_ids": [1],}',
    b'{"model": "m" "token_ids": [1]}',
    b'{"model": "m", "token_ids": [1]',
    b'{"model": "m", "token_ids": [1], "block_size": 0}',
    b'{"model": "m", "token_ids": [1], "block_size": tru}',
    b'{"model": 5, "token_ids": [1]}',
    b'{"model": "m\x01", "token_ids": [1]}',
    b'{"model": "m", "token_ids": null}',
    b'{"model": "m", "token_ids": "[1]"}',
    b'{"model": "m"}',
    b'{}', b'[]', b'', b'{"token_ids": [1]}', b'{"model": "m", "token_ids": [1], "x": "unterminated}',
]


@pytest.mark.requires("accel")
@pytest.mark.parametrize("body", BODIES)
def test_c_scan_of_the_whole_body_agrees_with_msgspec(body, monkeypatch):
    assert _decode_body(body, monkeypatch, True) == _decode_body(body, monkeypatch, False)


@pytest.mark.requires("accel")
@pytest.mark.parametrize("body", [
    b'{"model": "m", "token_ids": [1], "x": "ab\\',  # the body ends on a backslash in a value
    b'{"token_ids": [1], "a\\',                       # ... in a key after the ids
    b'{"model": "m\\',                                # ... before the ids
    b'{"model": "m", "extra": ["\\',                 # ... in a nested string
])
def test_a_body_ending_on_a_backslash_in_a_string_is_refused_like_msgspec(body, monkeypatch):
    """The scan stops at the end of the body after an escape's backslash (it must not step past
    the end to look for the escaped byte) and the body is msgspec's to refuse."""
    assert body.endswith(b"\\")
    assert api.native.query_ids(body) is None
    for cut in range(1, len(body) + 1):  # and every prefix of it
        chunk = body[:cut]
        assert _decode_body(chunk, monkeypatch, True) == _decode_body(chunk, monkeypatch, False)
    assert _decode_body(body, monkeypatch, True)[0] == "error"


@pytest.mark.requires("accel")
def test_c_scan_agrees_with_msgspec_on_random_mutations(monkeypatch):
    import random
    rng = random.Random(17)
    seed = b'{"model": "m", "cache_salt": "a]\\"b", "seq_hashes": [1, 2], "token_ids": [10, 200, 3000]}'
    alphabet = b'{}[]",:\\ 0123456789abtru-.e'
    for _ in range(3000):
        body = bytearray(seed)
        for _ in range(rng.randrange(1, 4)):
            i = rng.randrange(len(body) + 1)
            op = rng.randrange(3)
            if op == 0 and body:
                del body[min(i, len(body) - 1)]
            elif op == 1:
                body.insert(i, rng.choice(alphabet))
            elif body:
                body[min(i, len(body) - 1)] = rng.choice(alphabet)
        got = _decode_body(bytes(body), monkeypatch, True)
        assert got == _decode_body(bytes(body), monkeypatch, False), bytes(body)


@pytest.mark.requires("accel")
def test_parsed_ids_are_an_int64_array_and_by_hash_bodies_skip_it():
    body = msgspec.json.encode({"model": "m", "token_ids": list(range(70000, 70000 + 4096))})
    req = api._decode_query(body, "application/json", by_hash=False)
    assert isinstance(req.token_ids, np.ndarray) and req.token_ids.dtype == np.int64
    assert req.token_ids.tolist() == list(range(70000, 70000 + 4096))
    hb = msgspec.json.encode({"model": "m", "seq_hashes": [1, 2**64 - 1]})
    req = api._decode_query(hb, "application/json", by_hash=True)
    assert req.token_ids is None and req.seq_hashes == [1, 2**64 - 1]
    with pytest.raises(RequestValidationError):
        api._decode_query(hb, "application/json", by_hash=False)  # no token ids: 422


def test_parse_ids_rejects_what_json_does_not_allow():
    requires("accel")
    p = api.native.parse_ids
    assert np.frombuffer(p(b"[7, 4294967295]"), np.int64).tolist() == [7, 4294967295]
    for bad in (b"[01]", b"[-1]", b"[1,]", b"[1 2]", b"[4294967296]", b"", b"[", b"[1]x", b"[1.5]"):
        assert p(bad) is None, bad
