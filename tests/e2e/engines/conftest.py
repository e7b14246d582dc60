"""SGLang and LMCache on kvplane: a master with KV events, a pool segment, a conductor, and the
engines in the engines venv (skipped with a reason when it is absent; a failure in CI).

Every engine runs as a subprocess of the engines venv (tests.support.engines_harness). Engine
instance A and engine instance B are two separate processes; each op builds a fresh engine
instance inside its process, so B starts with empty local tiers.
"""

from __future__ import annotations

import contextlib
import os
import pathlib

import httpx
import pytest

from kvplane.conductor.config import ConductorConfig
from kvplane.conductor.server import ConductorServer
from kvplane.store import MasterServer, StoreClient
from tests.support.conductor_fixtures import _wait_seq
from tests.support.engines_harness import EngineDriver, need_engines
from tests.support.store_procs import spawn_segment

PAGE = 32  # tokens per SGLang page and per LMCache chunk in these tests


@pytest.fixture(scope="module")
def pool():
    """A master publishing KV events, and a 256 MiB segment process holding the pool."""
    need_engines()
    with MasterServer(admin_port=None, kv_events_port=0) as master:
        addr = f"127.0.0.1:{master.port}"
        segment = spawn_segment(addr, "256MiB")
        try:
            yield master, addr
        finally:
            segment.stop()


@pytest.fixture(scope="module")
def engine_pair(request, tmp_path_factory):
    """Instance A's process and instance B's process for the module's ``ENGINE``."""
    need_engines()
    engine = request.module.ENGINE
    logs = tmp_path_factory.mktemp(f"{engine}-logs")
    with contextlib.ExitStack() as stack:
        a = stack.enter_context(EngineDriver(engine, logs / "A.log", ready_timeout=None))
        b = stack.enter_context(EngineDriver(engine, logs / "B.log", ready_timeout=None))
        for d in (a, b):  # ``import mooncake`` resolves to kvplane's shim, never real Mooncake
            d.ready(300)
            assert "mooncake_shim" in (d.info["mooncake"] or ""), d.info
        yield a, b


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


@pytest.fixture(scope="module")
def conductor(pool):
    """A conductor with the pool's KV events registered (type kvplane) and one engine, e0,
    whose queries count pool blocks as its CPU tier."""
    master, _ = pool
    srv = ConductorServer(ConductorConfig(port=0, bind=("tcp://127.0.0.1:0",))).start(timeout=10)
    client = httpx.Client(base_url=srv.url, timeout=10, trust_env=False)
    try:
        r = client.post("/register", json={
            "instance_id": "pool", "type": "kvplane", "modelname": "tiny", "block_size": PAGE,
            "endpoint": master.events.endpoint, "replay_endpoint": master.events.replay_endpoint})
        assert r.status_code == 200, r.text
        r = client.post("/register", json={"instance_id": "e0", "modelname": "tiny",
                                           "block_size": PAGE, "topic": "kv@e0"})
        assert r.status_code == 200, r.text
        master.events.pub.wait_subscribed()
        yield srv, client
    finally:
        client.close()
        srv.close()


def pool_hit_tokens(conductor_, master: MasterServer, hashes: list[int]) -> int:
    """Tokens of the chain ``hashes`` the conductor sees in the pool, once every batch the master
    published so far is applied."""
    srv, client = conductor_
    _wait_seq(srv, "pool", master.events.pub._seq - 1)
    body = {"model": "tiny", "seq_hashes": hashes, "block_size": PAGE}
    r = client.post("/query_by_hash", json=body)
    assert r.status_code == 200, r.text
    return r.json()["default"]["e0"]["CPU"]
