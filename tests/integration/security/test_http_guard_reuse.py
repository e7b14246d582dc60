"""The pre-authenticating HTTP server and keep-alive clients: answers, never resets.

A tokenless probe of /health is answered and then its connection closed; a client that reuses
that connection must be told (Connection: close), or its next request meets a reset. A refused
request with a body must get its 401, not a reset from the unread body.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from fastapi import FastAPI

from kvplane.common.auth import token_authenticator
from kvplane.common.http import GuardedServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture
def server():
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"ok": True}

    @app.api_route("/thing", methods=["GET", "POST"])
    async def thing() -> dict:
        return {"thing": 1}

    guarded = GuardedServer(app, "127.0.0.1", 0, token_authenticator("s3cret"), "test")
    thread = threading.Thread(target=lambda: asyncio.run(guarded.serve()), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{guarded.port}"
    guarded.stop()
    thread.join(10)


def test_a_tokenless_health_probe_then_a_request_on_the_same_client_is_answered(server):
    errors, codes = [], set()
    for _ in range(60):
        with httpx.Client(timeout=10, trust_env=False) as client:
            health = client.get(server + "/health")
            assert health.status_code == 200
            assert health.headers.get("connection") == "close"
            try:
                codes.add(client.request("GET", server + "/thing", json={"a": 1}).status_code)
            except httpx.HTTPError as exc:  # a reset or a silent disconnect
                errors.append(type(exc).__name__)
    assert errors == [] and codes == {401}


def test_refused_requests_with_bodies_get_their_401(server):
    with httpx.Client(timeout=10, trust_env=False) as client:
        for size in (2, 10_000, 200_000):
            r = client.post(server + "/thing", content=b"x" * size)
            assert r.status_code == 401, size
        ok = client.post(server + "/thing", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
