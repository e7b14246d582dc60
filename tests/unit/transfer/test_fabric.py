"""kvplane.transfer.fabric: what a requested protocol becomes, with NIXL installed or not, and
that the choice is visible (engine accessor, metric) and the TCP fallback warns exactly once."""

from __future__ import annotations

import logging

import pytest

from kvplane.common import metrics
from kvplane.common.errors import InvalidArgument
from kvplane.integrations.store_backend import StoreBackendConfig
from kvplane.integrations.vllm.config import ConnectorConfig
from kvplane.transfer import fabric
from kvplane.transfer.config import EngineConfig
from kvplane.transfer.plugins import TRANSPORTS

pytestmark = pytest.mark.timeout(60)
STANDIN = "fabric-standin"  # a stand-in registered under a test name, playing NIXL


@pytest.fixture(autouse=True)
def _fresh_warning():
    fabric._reset_warning()
    yield
    fabric._reset_warning()


@pytest.fixture
def missing(monkeypatch):
    """NIXL not installed."""
    monkeypatch.setattr(fabric, "nixl_package", lambda: None)
    monkeypatch.setenv("KVPLANE_NIXL", "auto")


@pytest.fixture
def installed(monkeypatch):
    """NIXL installed and its transport registered (a stand-in under a test name)."""
    if STANDIN not in TRANSPORTS.names():
        TRANSPORTS.register(STANDIN, "kvplane.transfer.transports.loopback:LoopbackTransport")
    monkeypatch.setattr(fabric, "NIXL", STANDIN)
    monkeypatch.setattr(fabric, "nixl_package", lambda: "nixl_cu12")
    monkeypatch.setenv("KVPLANE_NIXL", "auto")


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == fabric.__name__ and r.levelno == logging.WARNING]


def test_rdma_without_nixl_is_tcp_with_one_warning_naming_the_install(missing, caplog):
    caplog.set_level(logging.WARNING, logger=fabric.__name__)
    for name in ("rdma", "RDMA", "efa", "nvlink"):
        choice = fabric.resolve(name)
        assert (choice.protocol, choice.transports) == ("tcp", fabric.DEFAULT_TRANSPORTS)
        assert fabric.INSTALL_HINT in choice.reason and "TCP" in choice.reason
    lines = _warnings(caplog)
    assert len(lines) == 1, lines  # once per process, however many engines ask
    assert "rdma" in lines[0] and "pip install --no-deps nixl-cu12==1.5.1" in lines[0]


def test_rdma_with_nixl_is_nixl_loaded_next_to_the_defaults(installed, caplog):
    caplog.set_level(logging.WARNING, logger=fabric.__name__)
    choice = fabric.resolve("rdma")
    assert choice.protocol == STANDIN and choice.requested == "rdma"
    assert choice.transports == (*fabric.DEFAULT_TRANSPORTS, STANDIN)
    assert "NIXL" in choice.reason
    assert _warnings(caplog) == []


def test_auto_loads_nixl_when_installed_and_prefers_shm_first(installed):
    choice = fabric.resolve("")
    assert choice.requested == "auto" and choice.protocol == "auto"
    assert STANDIN in choice.transports and "shm" in choice.transports
    assert choice.reason.index("shm") < choice.reason.index("nixl") < choice.reason.index("tcp")


def test_auto_without_nixl_loads_the_defaults(missing):
    choice = fabric.resolve("auto")
    assert (choice.protocol, choice.transports) == ("auto", fabric.DEFAULT_TRANSPORTS)
    assert "not installed" in choice.reason


def test_explicit_nixl_missing_is_a_clear_error(missing):
    with pytest.raises(InvalidArgument, match="nixl.*not installed.*pip install --no-deps nixl-cu12"):
        fabric.resolve("nixl")
    with pytest.raises(InvalidArgument, match="not installed"):
        EngineConfig(protocol="nixl")


def test_kvplane_nixl_off_keeps_defaults_off_but_on_requires_it(installed, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger=fabric.__name__)
    monkeypatch.setenv("KVPLANE_NIXL", "off")
    assert fabric.resolve("auto").transports == fabric.DEFAULT_TRANSPORTS
    off = fabric.resolve("rdma")
    assert off.protocol == "tcp" and "KVPLANE_NIXL=off" in off.reason
    assert len(_warnings(caplog)) == 1
    monkeypatch.setattr(fabric, "nixl_package", lambda: None)
    monkeypatch.setenv("KVPLANE_NIXL", "on")
    with pytest.raises(InvalidArgument, match="KVPLANE_NIXL=on"):
        fabric.resolve("auto")
    monkeypatch.setenv("KVPLANE_NIXL", "sometimes")
    with pytest.raises(InvalidArgument, match="KVPLANE_NIXL"):
        fabric.resolve("auto")


def test_explicit_transports_are_not_widened_and_plain_protocols_pass(installed):
    assert fabric.resolve("auto", ("tcp",)).transports == ("tcp",)
    assert fabric.resolve("tcp").transports == fabric.DEFAULT_TRANSPORTS
    assert fabric.resolve("shm").protocol == "shm"
    with pytest.raises(InvalidArgument):
        fabric.resolve("carrier-pigeon")


def test_the_probe_finds_the_package_without_importing_it(monkeypatch):
    import importlib.util

    seen: list[str] = []
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: seen.append(name) or (object() if name == "nixl" else None))
    fabric.nixl_package.cache_clear()
    try:
        assert fabric.nixl_package() == "nixl" and fabric.nixl_package() == "nixl"
        assert seen == ["nixl_cu12", "nixl"]  # probed once, in preference order
    finally:
        fabric.nixl_package.cache_clear()


def test_engine_config_and_engine_say_what_was_chosen(installed):
    from kvplane.transfer.engine import TransferEngine

    cfg = EngineConfig(protocol="rdma")
    assert cfg.protocol == STANDIN and cfg.fabric.requested == "rdma"
    with TransferEngine(cfg) as te:
        assert te.fabric == cfg.fabric
        assert te.transports_loaded == (*fabric.DEFAULT_TRANSPORTS, STANDIN)
    text = metrics.render()[0].decode()
    assert (f'kvplane_transfer_fabric_info{{protocol="{STANDIN}",requested="rdma",'
            f'transports="tcp,shm,file,local,{STANDIN}"}} 1.0') in text


def test_integrations_keep_the_request_for_the_engine_to_resolve(missing):
    assert ConnectorConfig.from_mapping({"protocol": "RDMA"}).protocol == "rdma"
    assert StoreBackendConfig.from_mapping({"protocol": ""}).protocol == "auto"
    with pytest.raises(InvalidArgument):
        ConnectorConfig.from_mapping({"protocol": "carrier-pigeon"})
    with pytest.raises(InvalidArgument):
        StoreBackendConfig(protocol="carrier-pigeon")
