"""Test prerequisites: skip with a one-line reason locally, fail loudly in CI (``CI`` set).

One table, :data:`REQUIREMENTS`, names every outside dependency a test may need (server
binaries, heavy packages, external venvs, a browser) and how to install it. Three spellings,
one rule:

    @pytest.mark.requires("etcd")                 # a test, class or module (kvplane.testing.plugin)
    exe = requires("etcd")                        # in a fixture: the binary's path
    torch = need_module("torch", "pip install torch==2.13.0")   # at the top of a test module

The README's test command must pass in a fresh venv: what it did not install is skipped with a
reason that says how to enable it. ``.ci/run`` installs everything and sets ``CI=true``, so there
a missing prerequisite is a failure, never a silent skip.

pytest is imported only when a requirement is missing, so importing this module never needs it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NoReturn

TORCH = "pip install torch==2.13.0"


def missing(what: str, how: str) -> NoReturn:
    """Skip the test (or module) because ``what`` is absent; in CI fail instead."""
    import pytest

    msg = f"{what} is not available: {how}"
    if os.environ.get("CI"):
        pytest.fail(f"{msg} (CI must install it: see .ci/run)", pytrace=False)
    pytest.skip(msg, allow_module_level=True)


def need_module(name: str, how: str) -> ModuleType:
    """Import ``name`` for a test module, or skip the module with ``how`` to install it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        missing(f"Python package {name!r}", how)


def _binary(*names: str) -> Callable[[], str | None]:
    return lambda: next(filter(None, map(shutil.which, names)), None)


def _module(name: str) -> Callable[[], Any]:
    def find() -> Any:
        try:
            return importlib.import_module(name)
        except ImportError:
            return None
    return find


def _spec(name: str) -> Callable[[], Any]:
    """Found without importing it (NIXL's libraries stay out of the pytest process)."""
    return lambda: importlib.util.find_spec(name)


def _executable(env: str, default: str) -> Callable[[], str | None]:
    def find() -> str | None:
        path = os.environ.get(env, default)
        return path if os.access(path, os.X_OK) else None
    return find


@dataclass(frozen=True)
class Requirement:
    """One outside dependency: what it is (for the reason), how to find it, how to install it."""

    what: str
    find: Callable[[], Any]
    how: str


REQUIREMENTS: dict[str, Requirement] = {
    "etcd": Requirement("etcd", _binary("etcd"), "apt-get install etcd-server"),
    "redis": Requirement("Redis", _binary("redis-server"), "apt-get install redis-server"),
    "chromium": Requirement("chromium",
                            _binary("chromium", "chromium-browser", "google-chrome", "chrome"),
                            "apt-get install chromium"),
    "torch": Requirement("Python package 'torch'", _module("torch"), TORCH),
    "nixl": Requirement("Python package 'nixl_cu12' (NVIDIA NIXL)", _spec("nixl_cu12"),
                        "pip install --no-deps nixl-cu12==1.5.1 (or bash .ci/setup-50-nixl.sh)"),
    # the conductor's C path: the numpy fallback would otherwise pass its tests for it
    "accel": Requirement("the conductor's C accelerator (kvplane.conductor._accel)",
                         _module("kvplane.conductor._accel"),
                         "install a C compiler and OpenSSL headers, then pip install -e ."),
    "store_accel": Requirement("the object table's C accelerator (kvplane.store.master._table)",
                               _module("kvplane.store.master._table"),
                               "install a C compiler, then pip install -e ."),
    "vllm": Requirement("the vLLM venv (KVPLANE_VLLM_PYTHON)",
                        _executable("KVPLANE_VLLM_PYTHON", "/opt/kvplane-vllm-venv/bin/python"),
                        "bash .ci/setup-10-vllm-venv.sh && bash .ci/setup-20-vllm-kvplane.sh"),
    "engines": Requirement("the engines venv (KVPLANE_ENGINES_PYTHON)",
                           _executable("KVPLANE_ENGINES_PYTHON",
                                       os.environ.get("KVPLANE_ENGINES_VENV",
                                                      "/opt/kvplane-engines-venv")
                                       + "/bin/python"),
                           "bash .ci/setup-30-engines-venv.sh && "
                           "bash .ci/setup-40-engines-kvplane.sh"),
}


def available(name: str) -> bool:
    """Whether requirement ``name`` (a key of :data:`REQUIREMENTS`) is here; never skips."""
    return REQUIREMENTS[name].find() is not None


def requires(name: str) -> Any:
    """The requirement's path (binary, venv python) or module; skips (CI: fails) when absent.

    Raises:
        KeyError: ``name`` is not in :data:`REQUIREMENTS` (the message lists them).
    """
    try:
        req = REQUIREMENTS[name]
    except KeyError:
        raise KeyError(f"unknown requirement {name!r}; known: {sorted(REQUIREMENTS)}") from None
    found = req.find()
    if found is None:
        missing(req.what, req.how)
    return found


__all__ = ["REQUIREMENTS", "Requirement", "available", "missing", "need_module", "requires"]
