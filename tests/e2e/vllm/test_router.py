"""`kvplane router` in front of 3 real vLLM CPU servers (0.32, tiny random-weight Llama).

The servers start once for the module and publish their KV events on ipc endpoints; each test
starts its own router (in process, so counters can be read) with one policy, after emptying every
prefix cache. The kill -9 test runs last, with the router as its own process: it kills one
instance for good.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from vllm_harness import BS, requires_vllm

from kvplane.common.errors import Timeout
from kvplane.common.procs import Proc
from kvplane.conductor.gateway.config import BackendSpec, GatewayConfig
from kvplane.conductor.gateway.server import GatewayServer
from tests.support.auth import headers
from tests.support.services import wait_until
from tests.support.vllm_harness import OpenAIServer

# 600 s: the first test's budget also covers starting the 3 servers
pytestmark = [pytest.mark.e2e, requires_vllm, pytest.mark.timeout(600)]
WORDS = [w for w in range(20, 1000) if not str(w).startswith("1")]  # 1:1 words in the tiny tokenizer
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
CLI = [sys.executable, "-m", "kvplane.cli.main"]


def stop_and_read(proc: Proc) -> str:
    """Stop the router process and return the tail of its log (for a failure message)."""
    proc.popen.terminate()
    try:
        proc.popen.wait(20)
    except subprocess.TimeoutExpired:
        proc.popen.kill()
        proc.popen.wait(10)
    try:
        return proc.popen.stderr.read()[-6000:] if proc.popen.stderr else ""
    except (OSError, ValueError) as exc:
        return f"(log unreadable: {exc})"


def text(seed: int, n: int) -> str:
    """``n`` words the tiny model's tokenizer maps to ``n`` tokens."""
    return " ".join(f"t{WORDS[(seed * 131 + i * 17) % len(WORDS)]}" for i in range(n))


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("router-e2e")
    (tmp / "chat.jinja").write_text(CHAT_TEMPLATE)  # the tiny tokenizer has no chat template
    out = [OpenAIServer(tiny_model, tmp / f"vllm{i}.log", events=f"ipc://{tmp}/kv{i}",
                        replay=f"ipc://{tmp}/replay{i}",
                        extra=["--chat-template", str(tmp / "chat.jinja")]) for i in range(3)]
    try:
        for s in out:
            wait_until(s.ready, 240, f"vLLM server {s.url}")
        yield out
    finally:
        for s in out:
            s.close()


def specs(servers) -> tuple[BackendSpec, ...]:
    return tuple(BackendSpec(s.url, events=f"ipc://{s.log_path.parent}/kv{i}",
                             replay=f"ipc://{s.log_path.parent}/replay{i}")
                 for i, s in enumerate(servers))


def router(servers, policy: str, health_timeout_s: float = 1.0) -> GatewayServer:
    """A started router over ``servers`` (1 s health timeout: a loaded box answers slowly)."""
    live = [s for s in servers if s.proc.poll() is None]
    for s in live:
        s.reset_prefix_cache()
    cfg = GatewayConfig(port=0, backends=specs(servers), policy=policy,
                        health_timeout_s=health_timeout_s)
    server = GatewayServer(cfg).start()
    wait_until(lambda: len(server.pool.healthy()) == len(live), 30, "backends in rotation")
    return server


def complete(url: str, prompt: str, max_tokens: int = 4, headers: dict[str, str] | None = None,
             **extra) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120, trust_env=False, headers=headers)
    assert r.status_code == 200, r.text
    return r


def indexed_blocks(server: GatewayServer, backend: str) -> int:
    return sum(r["blocks"]["GPU"] for r in server.conductor.instances() if r["instance_id"] == backend)


def test_prefix_sharing_requests_go_to_the_holder(servers):
    shared = text(1, 8 * BS)  # 8 full blocks
    with router(servers, "mooncake") as server:
        first = complete(server.url, shared + " " + text(2, 5)).headers["x-kvplane-backend"]
        # the router learnt it from the holder's KV events, hashed as vLLM hashes
        assert server.conductor.wait_until(lambda: indexed_blocks(server, first) >= 8, 30)
        assert all(r["hash_status"] != "mismatch" for r in server.conductor.instances())
        by_url = {s.url.split("://")[1]: s for s in servers}
        hits = {k: s.metric("vllm:prefix_cache_hits_total") for k, s in by_url.items()}
        for i in range(4):
            got = complete(server.url, shared + " " + text(10 + i, 7)).headers["x-kvplane-backend"]
            assert got == first
        # vLLM's own counters: the holder served the 4 shared prefixes from its cache
        gained = {k: s.metric("vllm:prefix_cache_hits_total") - hits[k] for k, s in by_url.items()}
        assert gained[first] >= 4 * 8 * BS
        assert all(v == 0 for k, v in gained.items() if k != first)
        route = httpx.post(server.url + "/route", json={"model": "tiny", "prompt": shared},
                           timeout=30, trust_env=False).json()
        assert route["prefill"]["id"] == first and route["prefix_blocks"] == 8


def test_round_robin_spreads_prefix_sharing_requests(servers):
    shared = text(3, 8 * BS)
    with router(servers, "round-robin") as server:
        seen = [complete(server.url, shared + " " + text(20 + i, 5)).headers["x-kvplane-backend"]
                for i in range(6)]
        assert sorted(seen) == sorted([s.url.split("://")[1] for s in servers] * 2)


def stream_tokens(url: str, path: str, body: dict) -> tuple[list[int], str, str]:
    """(generated token ids, text, backend) of a streamed answer.

    vLLM may put several tokens in one event when its output queue coalesces, so streams are
    compared token by token, not event by event.
    """
    r = httpx.post(url + path, json={**body, "stream": True, "return_token_ids": True},
                   timeout=120, trust_env=False)
    assert r.status_code == 200, r.text
    events = [e for e in r.text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
    ids, out = [], ""
    for e in events[:-1]:
        choices = json.loads(e[6:])["choices"]
        if not choices:
            continue
        ids += choices[0].get("token_ids") or []
        out += choices[0].get("text") or (choices[0].get("delta") or {}).get("content") or ""
    return ids, out, r.headers.get("x-kvplane-backend", "")


def test_streaming_through_the_router_equals_direct_output(servers):
    prompt = text(5, 3 * BS + 7)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": text(6, 2 * BS)}],
            "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with router(servers, "mooncake") as server:
        for path, b in (("/v1/completions", body), ("/v1/chat/completions", chat)):
            via, via_text, backend = stream_tokens(server.url, path, b)
            direct, direct_text, _ = stream_tokens(f"http://{backend}", path, b)  # cached there too
            assert len(via) == b["max_tokens"]
            assert via == direct and via_text == direct_text


def test_bench_router_smoke(servers, capsys):
    """benchmarks/router.py, tiny: 3 policies side by side on these servers, the simulator beside."""
    bench = pathlib.Path(__file__).resolve().parents[3] / "benchmarks" / "router.py"
    spec = importlib.util.spec_from_file_location("bench_router", bench)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_router"] = mod
    spec.loader.exec_module(mod)
    argv = ["--requests", "6", "--max-blocks", "6", "--fit-lengths", "32,96", "--fit-reps", "1",
            "--load", "0.5", "--repeat", "1"]
    for b in specs(servers):
        argv += ["--backend", f"{b.url},events={b.events},replay={b.replay}"]
    rc = mod.main(argv)
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = json.loads(out.strip().splitlines()[-1])
    assert [r["policy"] for r in rows] == ["mooncake", "least-loaded", "round-robin"]
    for r in rows:
        assert r["errors"] == 0 and r["ttft_mean_s"] > 0 and r["ttft_p90_s"] >= r["ttft_mean_s"] * 0.5
        assert 0 <= r["hit_ratio"] <= 1 and r["sim"]["ttft_mean_s"] > 0
    assert "fit: c0=" in out and "simulated / measured TTFT mean" in out


def test_kill9_under_load_retries_ejects_and_recovers(servers):
    # The router runs as its own process, as deployed, at nice -10: in the test process its
    # event loop shared the GIL with the streaming clients below, and at equal priority with
    # three vLLM servers spinning on 2 cores it still lagged by up to 1.9 s (deployed, it would
    # have its own core). Default health settings (0.5 s interval and timeout).
    args = ["nice", "-n", "-10", *CLI, "router", "--policy", "round-robin", "--port", "0"]
    for s in servers:
        args += ["--backend", s.url]
    proc = Proc(args, ready_timeout=60, stop_signal=signal.SIGTERM)
    url, auth = proc.info["router"], headers()
    try:
        by_id = {s.url.split("://")[1]: s for s in servers}

        def rows() -> dict[str, dict]:
            r = httpx.get(url + "/backends", headers=auth, timeout=10, trust_env=False)
            return {b["id"]: b for b in r.json()}

        def retries() -> float:  # the router's kvplane_router_retries_total{phase="both"}
            text_ = httpx.get(url + "/metrics", headers=auth, timeout=10, trust_env=False).text
            return sum(s.value for fam in text_string_to_metric_families(text_) for s in fam.samples
                       if s.name == "kvplane_router_retries_total" and s.labels.get("phase") == "both")

        wait_until(lambda: all(b["up"] for b in rows().values()), 60, "backends in rotation")
        before = retries()
        results: list[tuple[str, str, float]] = []

        def one(i: int) -> None:
            start = time.monotonic()
            try:
                r = httpx.post(url + "/v1/completions", timeout=120, trust_env=False, headers=auth,
                               json={"model": "tiny", "prompt": text(40 + i, 2 * BS), "stream": True,
                                     "max_tokens": 400, "temperature": 0, "ignore_eos": True})
                results.append((r.headers.get("x-kvplane-backend", ""), r.text, time.monotonic() - start))
            except httpx.HTTPError as exc:  # pragma: no cover - reported by the assert below
                results.append(("", f"client error {exc}", time.monotonic() - start))

        # round robin: 4 requests per instance, 2 running there (max-num-seqs 2), the others
        # queued or not sent yet. The clients start over a second or more on this loaded box,
        # so the 4 need not all be open at once: a full run once saw all 12 finish, 4 per
        # instance, with the victim never at 3 open. Kill once 2 are open there; 400 tokens
        # each (64 + 400 < the 512 context) keep them open long enough to be seen. The victim
        # is the first instance in rotation seen with 2 open: on this loaded box a fixed one
        # was once ejected by slow health checks before any request reached it.
        threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        picked: list[str] = []

        def two_open() -> bool:
            picked[:] = [b["id"] for b in rows().values() if b["up"] and b["in_flight"] >= 2][:1]
            return bool(picked)

        try:
            wait_until(two_open, 60, "2 requests in flight on one instance")
        except Timeout as exc:  # say where the requests went (a backend ejected meanwhile?)
            raise AssertionError(f"{exc}: backends {list(rows().values())}, finished "
                                 f"{[(r[0], r[1][-160:]) for r in results]}") from exc
        vid = picked[0]
        victim = by_id[vid]
        open_there = rows()[vid]["in_flight"]

        refused: list[float] = []

        def probe() -> None:  # when the dying instance's port starts refusing connections
            while not refused:
                try:
                    socket.create_connection(("127.0.0.1", victim.port), timeout=0.2).close()
                except ConnectionRefusedError:
                    refused.append(time.time())
                except OSError:
                    pass

        answered: list[float] = []  # when the router's event loop answered /backends

        def up() -> bool:
            b = rows()[vid]
            answered.append(time.time())
            return not b["up"]

        killed = time.time()
        victim.kill(reap=False)  # from this thread; reaped in another
        reaper, prober = threading.Thread(target=victim.proc.wait, args=(30,)), threading.Thread(target=probe)
        reaper.start()
        prober.start()
        wait_until(up, 10, "ejection")
        ejected = rows()[vid]["ejected_at"]
        prober.join(10)
        # A SIGKILLed vLLM's port went on accepting connections for 0.55-1.63 s on this loaded box
        # (the probe), each check timing out meanwhile: ejected at the latest one check (0.5 s,
        # +0.5 s slack) after the port refuses. The router's event loop was seen stalled for
        # 1.3 s right after a kill (no line logged, no request answered: the box's 2 cores were
        # busy with the dying instance and the live ones): such a stall, measured as the
        # longest gap between two answers to /backends, is added to the bound.
        stall = max((b - a for a, b in zip([killed, *answered], answered)), default=0.0)
        assert refused and ejected - refused[0] <= 0.5 + 0.5 + stall, (
            f"ejected {ejected - killed:.2f}s after the kill, router stalled up to {stall:.2f}s, "
            f"refused from "
            f"{refused[0] - killed if refused else None}s; backends {rows()}; router log:\n"
            f"{stop_and_read(proc)}")
        reaper.join(60)
        assert victim.proc.poll() is not None
        for t in threads:
            t.join(180)
        assert len(results) == 12 and not any(t.is_alive() for t in threads)
        done = [r for r in results if r[1].endswith("data: [DONE]\n\n") and '"error"' not in r[1]]
        broken = [r for r in results if '"error"' in r[1]]
        assert len(done) + len(broken) == 12, [r[1][-300:] for r in results]
        # only streams that had started on the victim end in an error (a string message: pytest
        # cuts the repr of a tuple before the error text)
        elsewhere = [r for r in broken if r[0] != vid]
        assert not elsewhere, (f"victim {vid}; broken elsewhere: "
                               + "; ".join(f"{r[0]} after {r[2]:.1f}s: {r[1][-300:]!r}" for r in elsewhere)
                               + f"; backends {rows()}; router log:\n{stop_and_read(proc)}")
        assert len(broken) <= 2 + 1  # at most what ran there (+1 if a retry raced the kill)
        # each of those open on the victim at the kill finished, broke after its first token, or
        # was retried elsewhere (the queued ones, unless they started first)
        retried = retries() - before
        finished = [r for r in done if r[0] == vid]
        assert retried + len(broken) + len(finished) >= max(open_there, 2), \
            (open_there, retried, len(broken), len(finished))
        for i in range(6):
            r = complete(url, text(90 + i, BS), headers=auth)
            assert r.headers["x-kvplane-backend"] != vid
    finally:
        proc.stop(20)
