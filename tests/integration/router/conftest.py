"""An HTTP client for the router tests (the router and its fakes come from tests.support.fake_vllm)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30, trust_env=False) as client:
        yield client
