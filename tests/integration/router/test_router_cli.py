"""`kvplane router` and its `pd-proxy` alias as processes: ready line, routing, bad flags, SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest

from kvplane.common.procs import Proc
from tests.support.auth import headers
from tests.support.fake_vllm import FakeVLLM, words

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
CLI = [sys.executable, "-m", "kvplane.cli.main"]


def test_router_process_serves_and_stops_on_sigterm():
    with FakeVLLM() as a, FakeVLLM() as b:
        proc = Proc([*CLI, "router", "--backend", a.url, "--backend", b.url, "--port", "0",
                     "--policy", "round-robin", "--bind", "tcp://127.0.0.1:0"],
                    ready_timeout=30, stop_signal=signal.SIGTERM)
        try:
            info = proc.info
            assert info["mode"] == "colocated" and info["policy"] == "round-robin"
            assert info["zmq"][0].startswith("tcp://127.0.0.1:")
            got = {httpx.post(info["router"] + "/v1/completions", json={"prompt": words(i)},
                              headers=headers(), timeout=10,
                              trust_env=False).headers["x-kvplane-backend"] for i in range(4)}
            assert got == {a.id, b.id}
            # secure by default: the token file's token, nothing without it
            tokenless = httpx.post(info["router"] + "/v1/completions", json={"prompt": words(9)},
                                   timeout=10, trust_env=False)
            assert tokenless.status_code == 401
        finally:
            proc.stop(20)
        # uvicorn shuts down gracefully, then re-raises the SIGTERM it caught; never a kill -9
        assert proc.popen.returncode in (0, -signal.SIGTERM)


def test_pd_proxy_alias_prints_the_old_ready_line():
    with FakeVLLM() as p, FakeVLLM() as d:
        proc = Proc([sys.executable, "-m", "kvplane.cli.pd_proxy", "--prefill", p.url, "--decode",
                     d.url, "--port", "0"], ready_timeout=30, stop_signal=signal.SIGTERM)
        try:
            assert proc.info["proxy"] == proc.info["router"] and proc.info["mode"] == "pd"
            r = httpx.post(proc.info["proxy"] + "/v1/completions", json={"prompt": words(1, 2)},
                           headers=headers(), timeout=10, trust_env=False)
            assert r.status_code == 200 and r.headers["x-kvplane-backend"] == d.id
            assert p.requests[0]["max_tokens"] == 1 and d.requests[0]["kv_transfer_params"]
        finally:
            proc.stop(20)


@pytest.mark.parametrize("args, message", [
    (["--policy", "nope", "--backend", "http://127.0.0.1:9"], "nope"),
    (["--backend", "127.0.0.1:9"], "http"),
    (["--prefill", "http://127.0.0.1:9"], "PD mode"),
    (["--backend", "http://127.0.0.1:9", "--set", "model.nope=1"], "unknown setting"),
])
def test_bad_flags_are_one_error_line(args, message):
    r = subprocess.run([*CLI, "router", "--port", "0", *args], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_router_process_discovers_backends_through_the_http_metadata_service():
    """The backend list read from kvplane's HTTP metadata server, its token on every call."""
    import json

    from kvplane.transfer.metadata import HttpMetadata
    from kvplane.transfer.metadata_server import serve_in_thread
    from tests.support.services import wait_until

    with serve_in_thread(token="s3cret") as meta_server, FakeVLLM() as a, FakeVLLM() as b:
        url = meta_server.url + "/metadata"
        meta = HttpMetadata(url, token="s3cret")
        meta.put("kvplane/router/backends", json.dumps([{"url": a.url}]).encode())
        auth = {"Authorization": "Bearer s3cret"}
        args = [*CLI, "router", "--discover", url, "--port", "0", "--policy", "round-robin"]
        proc = Proc([*args, "--token", "s3cret"], ready_timeout=30, stop_signal=signal.SIGTERM)
        wrong = Proc([*args, "--token", "wrong"], ready_timeout=30, stop_signal=signal.SIGTERM)
        try:
            router = proc.info["router"]

            def ids() -> set[str]:
                rows = httpx.get(router + "/backends", headers=auth, timeout=10, trust_env=False).json()
                return {r["id"] for r in rows if r["up"]}

            wait_until(lambda: ids() == {a.id}, 10, "first backend discovered")
            meta.put("kvplane/router/backends", json.dumps([{"url": a.url}, {"url": b.url}]).encode())
            wait_until(lambda: ids() == {a.id, b.id}, 15, "second backend discovered")
            got = {httpx.post(router + "/v1/completions", json={"prompt": words(i)}, headers=auth,
                              timeout=10, trust_env=False).headers["x-kvplane-backend"] for i in range(4)}
            assert got == {a.id, b.id}
            assert a.headers[-1]["authorization"] == "Bearer s3cret"  # the token goes upstream too
            # a router whose token the metadata service refuses discovers nothing and says so
            h = httpx.get(wrong.info["router"] + "/health", timeout=10, trust_env=False)
            assert h.status_code == 503 and h.json()["backends"] == 0
        finally:
            proc.stop(20)
            wrong.stop(20)
            meta.close()
