"""Shared by the vLLM e2e tests: the skip rule, plus the drivers from kvplane.testing.vllm_harness."""

from __future__ import annotations

import os

import pytest

from kvplane.testing.vllm_harness import (  # noqa: F401  (re-exported for the tests)
    BS, VLLM_PYTHON, Driver, make_model, max_diff, prompt, store_kv_config, vllm_env,
)

requires_vllm = pytest.mark.skipif(
    not os.access(VLLM_PYTHON, os.X_OK),
    reason=f"no vLLM venv python at {VLLM_PYTHON} (run .ci/setup-10-vllm-venv.sh and "
           ".ci/setup-20-vllm-kvplane.sh, or set KVPLANE_VLLM_PYTHON)")
