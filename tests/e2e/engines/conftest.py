"""SGLang and LMCache on kvplane: a master with KV events, a pool segment, a conductor, and the
engines in the engines venv (skipped with a reason when it is absent; a failure in CI).

Every engine runs as a subprocess of the engines venv (tests.support.engines_harness). Engine
instance A and engine instance B are two separate processes; each op builds a fresh engine
instance inside its process, so B starts with empty local tiers.
"""

from __future__ import annotations

import contextlib

import httpx
import pytest

from kvplane.conductor.config import ConductorConfig
from kvplane.conductor.server import ConductorServer
from kvplane.store import MasterServer
from tests.support.engine_checks import PAGE
from tests.support.engines_harness import EngineDriver, need_engines
from tests.support.store_procs import spawn_segment


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
