"""Pytest fixtures for conductor tests: a real conductor and vLLM-like publishers (imported by conftests)."""

import contextlib

import httpx
import pytest

from kvplane.conductor.config import ConductorConfig
from kvplane.conductor.server import ConductorServer
from kvplane.kvevents.publisher import KVEventPublisher


@pytest.fixture
def make_server():
    servers = []

    def make(**kw):
        cfg = ConductorConfig(port=0, bind=("tcp://127.0.0.1:0",), **kw)
        srv = ConductorServer(cfg).start(timeout=10)
        servers.append(srv)
        return srv

    yield make
    for s in servers:
        s.close()


@pytest.fixture
def server(make_server):
    return make_server()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=10) as client:
        yield client


@pytest.fixture
def publishers():
    with contextlib.ExitStack() as stack:
        yield lambda **kw: stack.enter_context(KVEventPublisher(**kw))


@pytest.fixture
def wait_seq():
    """``wait_seq(server, instance, seq)``: block until that batch is applied (else fail)."""
    return _wait_seq


def _wait_seq(server, instance, seq, rank=0, tenant="default", timeout=10.0):
    stream = server.conductor.stream(tenant, instance, rank)
    assert stream is not None, f"{instance} not registered"
    assert server.conductor.wait_until(lambda: stream.last_seq == seq, timeout), (
        f"{instance} rank {rank}: seq {seq} not applied (last {stream.last_seq})")
