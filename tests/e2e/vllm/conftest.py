"""One tiny random-weight float32 Llama (with a word-level tokenizer) for the whole vLLM session."""

from __future__ import annotations

import pytest
from vllm_harness import make_model

from kvplane.testing.needs import requires


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Written by the vLLM venv's transformers into a session tmp dir (never load_format=dummy)."""
    requires("vllm")
    return str(make_model(tmp_path_factory.mktemp("tiny-llama") / "model"))
