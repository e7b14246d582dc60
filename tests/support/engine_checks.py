"""What the SGLang and LMCache e2e tests check (tests/e2e/engines): fresh prompts, byte-equal
KV, the pool's keys, a corrupted object, the pool hits the conductor sees. Imported by module
path (``from tests.support.engine_checks import ...``), never as ``conftest``: a module named
``conftest`` resolves to whichever directory's conftest pytest imported last."""

from __future__ import annotations

import os
import pathlib

from kvplane.store import MasterServer, StoreClient
from tests.support.conductor_fixtures import _wait_seq

PAGE = 32  # tokens per SGLang page and per LMCache chunk in these tests


def prompt(pages: int, extra: int = 0) -> list[int]:
    """Fresh token ids (a new prefix every call, so no earlier test's pages match; the suite
    seeds ``random`` per test, so the draw comes from os.urandom)."""
    base = int.from_bytes(os.urandom(3), "big") * 1024
    return list(range(base, base + pages * PAGE + extra))


def same_kv(a_file: pathlib.Path, b_file: pathlib.Path, tokens: int, token_bytes: int) -> bool:
    """The check: B holds KV for exactly ``tokens`` tokens and it equals A's byte for byte
    (the files are token-major, so a token prefix is a byte prefix)."""
    a, b = a_file.read_bytes(), b_file.read_bytes()
    return len(b) == tokens * token_bytes and len(a) >= len(b) and a[:len(b)] == b


def pool_keys(master: MasterServer) -> set[str]:
    with master.lock:
        return {k for k, o in master.state.objects.items() if o.complete}


def corrupt(addr: str, key: str) -> None:
    """Replace the object under ``key`` with the same bytes, last byte flipped (an upsert, so the
    store's own checks see a valid object: only the comparison can notice)."""
    with StoreClient(master=addr, protocol="tcp") as c:
        data = bytearray(c.get(key))
        data[-1] ^= 0xFF
        c.upsert(key, bytes(data))


def pool_hit_tokens(conductor_, master: MasterServer, hashes: list[int]) -> int:
    """Tokens of the chain ``hashes`` the conductor sees in the pool, once every batch the master
    published so far is applied."""
    srv, client = conductor_
    _wait_seq(srv, "pool", master.events.pub._seq - 1)
    body = {"model": "tiny", "seq_hashes": hashes, "block_size": PAGE}
    r = client.post("/query_by_hash", json=body)
    assert r.status_code == 200, r.text
    return r.json()["default"]["e0"]["CPU"]
