"""Shared fixtures: a clean KVPLANE_* environment, seeded randomness, real services."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest


# where the external engines live (read by the test kit, not kvplane settings), and the token file
_KEEP = ("KVPLANE_VLLM_PYTHON", "KVPLANE_MOONCAKE_PYTHON", "KVPLANE_ENGINES_VENV",
         "KVPLANE_ENGINES_PYTHON", "KVPLANE_TOKEN_FILE")


@pytest.fixture(scope="session", autouse=True)
def token_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One token file for the whole session, set before any fixture starts a service: services
    the tests start write it once, clients read it, and the user's home is never touched."""
    path = str(tmp_path_factory.mktemp("kvplane-auth") / "token")
    os.environ["KVPLANE_TOKEN_FILE"] = path
    return path


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, token_file: str) -> None:
    for k in list(os.environ):
        if k.startswith("KVPLANE_") and k not in _KEEP:
            monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("KVPLANE_TOKEN_FILE", token_file)
    random.seed(1234)
    np.random.seed(1234)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """``@pytest.mark.requires("etcd", ...)``: skip with the reason when one is missing (in CI,
    ``CI`` set, fail), before any fixture runs. Names: kvplane.testing.needs.REQUIREMENTS."""
    from kvplane.testing.needs import requires

    for mark in item.iter_markers("requires"):
        for name in mark.args:
            requires(name)


@pytest.fixture(scope="session")
def redis_url():
    from kvplane.testing.needs import requires
    from kvplane.testing.services import start_redis

    requires("redis")
    svc = start_redis()
    yield svc.url
    svc.stop()


@pytest.fixture(scope="session")
def etcd_url(tmp_path_factory: pytest.TempPathFactory):
    from kvplane.testing.needs import requires
    from kvplane.testing.services import start_etcd

    requires("etcd")
    svc = start_etcd(str(tmp_path_factory.mktemp("etcd")))
    yield svc.url
    svc.stop()
