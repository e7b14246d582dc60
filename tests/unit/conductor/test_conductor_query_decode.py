"""The JSON query decoder: the C id parser must agree with msgspec on every body, error or not."""

import msgspec
import numpy as np
import pytest
from fastapi.exceptions import RequestValidationError

from kvplane.conductor import api

pytestmark = pytest.mark.timeout(10)

IDS = [
    "[1,2,3]", " [ 1 ,\n2\t, 3 ] ", "[]", "null", "[0]", "[4294967295]", "[4294967296]", "[-1]",
    "[1.0]", "[1e3]", "[01]", "[00]", "[1,]", "[,1]", "[1 2]", '["1"]', "[true]", "[null]",
    "[" + "9" * 30 + "]", "[1", "1", "{}", "[[1]]", "[18446744073709551616]", "[ ]", "[-0]",
]


def _decode(text: str, monkeypatch, native: bool) -> object:
    if not native:
        monkeypatch.setattr(api, "_JSON_QUERY", api._PLAIN_JSON_QUERY)
    else:
        monkeypatch.setattr(api, "_JSON_QUERY", msgspec.json.Decoder(api._QueryWireRaw))
    body = ('{"model": "m", "block_size": 4, "token_ids": ' + text + "}").encode()
    try:
        req = api._decode_query(body, "application/json", by_hash=False)
    except RequestValidationError as exc:
        return ("error", exc.errors())
    finally:
        monkeypatch.undo()
    ids = req.token_ids
    return ("ok", None if ids is None else [int(t) for t in ids])


@pytest.mark.skipif(api.native is None, reason="the C accelerator was not built")
@pytest.mark.parametrize("text", IDS)
def test_c_parser_agrees_with_msgspec(text, monkeypatch):
    got, want = _decode(text, monkeypatch, True), _decode(text, monkeypatch, False)
    assert got == want
    if text.strip().startswith("[") and want[0] == "ok":
        assert want[1] == msgspec.json.decode(text.encode())


@pytest.mark.skipif(api.native is None, reason="the C accelerator was not built")
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
    if api.native is None:
        pytest.skip("the C accelerator was not built")
    p = api.native.parse_ids
    assert np.frombuffer(p(b"[7, 4294967295]"), np.int64).tolist() == [7, 4294967295]
    for bad in (b"[01]", b"[-1]", b"[1,]", b"[1 2]", b"[4294967296]", b"", b"[", b"[1]x", b"[1.5]"):
        assert p(bad) is None, bad
