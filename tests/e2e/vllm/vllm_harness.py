"""Shared by the vLLM e2e tests: the skip rule, plus the drivers from tests.support.vllm_harness."""

from __future__ import annotations

import pytest

from tests.support.vllm_harness import (  # noqa: F401  (re-exported for the tests)
    BS,
    VLLM_PYTHON,
    Driver,
    make_model,
    max_diff,
    offload_kv_config,
    prompt,
    store_kv_config,
    vllm_env,
)

requires_vllm = pytest.mark.requires("vllm")  # kvplane.testing.needs: skip, or fail in CI
