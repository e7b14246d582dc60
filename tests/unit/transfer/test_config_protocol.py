"""EngineConfig.from_env resolves the protocol it is given once: an explicit ``tcp`` never
loads NIXL (its agent's progress thread polls a core even while the engine is idle)."""

from __future__ import annotations

import pytest

from kvplane.transfer import fabric
from kvplane.transfer.config import EngineConfig
from kvplane.transfer.plugins import TRANSPORTS

pytestmark = pytest.mark.timeout(30)
STANDIN = "config-standin"  # plays NIXL: installed and registered


@pytest.fixture
def installed(monkeypatch):
    if STANDIN not in TRANSPORTS.names():
        TRANSPORTS.register(STANDIN, "kvplane.transfer.transports.loopback:LoopbackTransport")
    monkeypatch.setattr(fabric, "NIXL", STANDIN)
    monkeypatch.setattr(fabric, "nixl_package", lambda: "nixl_cu12")
    monkeypatch.setenv("KVPLANE_NIXL", "auto")


def test_an_explicit_protocol_from_env_loads_only_what_it_names(installed):
    assert STANDIN in EngineConfig.from_env().transports  # auto: NIXL when installed
    assert STANDIN in EngineConfig.from_env(protocol="auto").transports
    for proto in ("tcp", "shm"):
        cfg = EngineConfig.from_env(protocol=proto)
        assert cfg.protocol == proto
        assert STANDIN not in cfg.transports, cfg.transports
        assert cfg.transports == fabric.DEFAULT_TRANSPORTS
