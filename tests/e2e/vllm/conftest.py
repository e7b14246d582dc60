"""One tiny random-weight float32 Llama (with a word-level tokenizer) for the whole vLLM session."""

from __future__ import annotations

import os

import pytest

from vllm_harness import VLLM_PYTHON, make_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Written by the vLLM venv's transformers into a session tmp dir (never load_format=dummy)."""
    if not os.access(VLLM_PYTHON, os.X_OK):
        pytest.skip(f"no vLLM venv python at {VLLM_PYTHON}")
    return str(make_model(tmp_path_factory.mktemp("tiny-llama") / "model"))
