"""Shared fixtures: a clean KVPLANE_* environment, seeded randomness, real services."""

from __future__ import annotations

import os
import pathlib
import random

import numpy as np
import pytest

from tests.support.netns import netbed  # noqa: F401  (the multi-host test bed fixture, docs/testbed.md)

# where the external engines live (read by the test kit, not kvplane settings), and the token file
_KEEP = ("KVPLANE_VLLM_PYTHON", "KVPLANE_MOONCAKE_PYTHON", "KVPLANE_ENGINES_VENV",
         "KVPLANE_ENGINES_PYTHON", "KVPLANE_TOKEN_FILE")

# NIXL stays off for the suite (in-process and in every child), so thousands of engines do not
# each start a UCX agent; NIXL's own tests turn it on (monkeypatch.setenv("KVPLANE_NIXL", "auto"))
NIXL_ENV = ("KVPLANE_NIXL", "off")
os.environ[NIXL_ENV[0]] = NIXL_ENV[1]

# harness entry modules run as ``python -m tests.support.X`` from any cwd: the repo root goes on
# the children's path (pyproject's ``pythonpath`` puts it on this process's)
_ROOT = str(pathlib.Path(__file__).resolve().parents[1])
if _ROOT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)


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
    monkeypatch.setenv(*NIXL_ENV)
    random.seed(1234)
    np.random.seed(1234)


def pytest_configure(config: pytest.Config) -> None:
    """Load kvplane's pytest plugin (the ``requires`` marker) when the ``pytest11`` entry point
    did not (kvplane run from ``PYTHONPATH`` rather than installed)."""
    if not config.pluginmanager.has_plugin("kvplane"):
        from kvplane.testing import plugin

        config.pluginmanager.register(plugin, "kvplane")


@pytest.fixture(scope="session")
def redis_url():
    from kvplane.testing.needs import requires
    from tests.support.services import start_redis

    requires("redis")
    svc = start_redis()
    yield svc.url
    svc.stop()


@pytest.fixture(scope="session")
def etcd_url(tmp_path_factory: pytest.TempPathFactory):
    from kvplane.testing.needs import requires
    from tests.support.services import start_etcd

    requires("etcd")
    svc = start_etcd(str(tmp_path_factory.mktemp("etcd")))
    yield svc.url
    svc.stop()
