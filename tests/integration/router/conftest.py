"""A router (in process, real HTTP on 127.0.0.1) in front of FakeVLLM servers that publish KV events."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import pytest

from kvplane.conductor.gateway.config import BackendSpec, GatewayConfig
from kvplane.conductor.gateway.server import GatewayServer
from kvplane.testing.fake_vllm import FakeVLLM

BS = 4  # the fakes' block size: a prompt of 4n words is n blocks


@contextlib.contextmanager
def cluster(n: int = 3, roles: tuple[str, ...] = (), **kw: object) -> Iterator[tuple[GatewayServer, list[FakeVLLM]]]:
    """``n`` fakes behind a started router; ``roles`` (prefill/decode per fake) selects PD mode."""
    fakes = [FakeVLLM(block_size=BS) for _ in range(n)]
    roles = roles or ("both",) * n
    specs = tuple(BackendSpec(f.url, role) for f, role in zip(fakes, roles))  # type: ignore[arg-type]
    cfg = GatewayConfig(port=0, backends=specs, bind=("tcp://127.0.0.1:0",),
                        mode="pd" if "prefill" in roles else "colocated", **kw)  # type: ignore[arg-type]
    server = GatewayServer(cfg)
    try:
        server.start()
        (endpoint,) = server.zmq_endpoints
        for f, spec in zip(fakes, specs):
            f.attach(endpoint, spec.topic)
        yield server, fakes
    finally:
        server.close()
        for f in fakes:
            f.close()


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30, trust_env=False) as client:
        yield client


def words(*ids: int) -> str:
    """A prompt the fakes' tokenizer maps to ``ids``."""
    return " ".join(f"t{i}" for i in ids)
