"""Test prerequisites: skip with a one-line reason locally, fail loudly in CI (``CI`` set).

    torch = need_module("torch", "pip install torch==2.13.0")   # at the top of a test module
    need(shutil.which("etcd"), "etcd", "apt-get install etcd-server")

The README's test command must pass in a fresh venv: what it did not install is skipped with a
reason that says how to enable it. ``.ci/run`` installs everything and sets ``CI=true``, so there
a missing prerequisite is a failure, never a silent skip.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest


def missing(what: str, how: str) -> NoReturn:
    """Skip the test (or module) because ``what`` is absent; in CI fail instead."""
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
