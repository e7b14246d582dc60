"""An idle HTTP server sleeps: no polling thread, and it still stops at once when asked.

Every store segment process serves its metrics over HTTP, and a host may run dozens of them.
uvicorn's own loop and the front's selector each woke ten times a second; 64 idle segment
processes then took about a quarter of one of this machine's two cores, and a cold get or a
put beside them ran 30-50 % slower (docs/benchmarks.md, issue 32's fourth round).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from kvplane.common.auth import token_authenticator
from kvplane.common.http import QuietServer, ServerThread
from kvplane.common.procs import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

TICKS = 2  # the idle server is watched over this many of its Date-header refreshes


def _wakeups(tid: int) -> int:
    """Voluntary context switches of thread ``tid`` of this process so far (each one a sleep
    that ended)."""
    with open(f"/proc/self/task/{tid}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches line")


def _refreshes(state: Any, n: int) -> None:
    """Until the server refreshed its Date header ``n`` more times (each refresh, once a
    second, sets a new ``default_headers`` list)."""
    seen = [state.default_headers]

    def refreshed() -> bool:
        now = state.default_headers
        if now is not seen[-1]:
            seen.append(now)
        return len(seen) > n

    wait_until(refreshed, 5 + 2 * n, f"{n} Date-header refreshes")


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/thing")
    async def thing() -> dict:
        return {"thing": 1}
    return app


def test_an_idle_server_does_not_poll():
    with ServerThread(_app(), authenticate=token_authenticator("s3cret"), name="idle") as srv:
        with httpx.Client(timeout=10, trust_env=False) as client:  # served, then idle
            r = client.get(srv.url + "/thing", headers={"Authorization": "Bearer s3cret"})
            assert r.status_code == 200 and r.json() == {"thing": 1}
        threads = [t for t in threading.enumerate()
                   if t.name in (f"idle-front-{srv.port}", f"http-idle-{srv.port}")]
        assert len(threads) == 2, [t.name for t in threading.enumerate()]
        tids = [t.native_id for t in threads]
        assert all(tid is not None for tid in tids)
        state = srv.server.server.server_state
        _refreshes(state, 1)  # start at a tick boundary
        before = [_wakeups(tid) for tid in tids if tid is not None]
        _refreshes(state, TICKS)  # TICKS seconds watched, as the server counts them
        after = [_wakeups(tid) for tid in tids if tid is not None]
        woke = dict(zip([t.name for t in threads], [b - a for a, b in zip(before, after)]))
        # the loop wakes once a refresh; the front not at all (a poll of 0.1 s each made this
        # >= 2 * 10 per second watched)
        assert sum(woke.values()) <= TICKS + 3, woke


def test_stop_is_prompt_and_the_threads_end():
    srv = ServerThread(_app(), name="stopper")
    assert isinstance(srv.server.server, QuietServer)
    front = srv.server.front._thread
    t0 = time.monotonic()
    srv.close()
    took = time.monotonic() - t0
    assert not srv._thread.is_alive() and not front.is_alive()
    assert took < QuietServer.TICK / 2, f"stop took {took:.3f} s (it waited for a tick)"


def test_a_slow_head_is_still_cut_off_by_its_deadline():
    """With no poll, the front must still wake for a pending connection's handshake deadline."""
    import dataclasses
    import socket

    from kvplane.common.guard import Limits

    limits = dataclasses.replace(Limits.from_env(), handshake_timeout=0.5)
    with ServerThread(_app(), authenticate=token_authenticator("s3cret"), name="slow",
                      limits=limits) as srv:
        s = socket.create_connection((srv.host, srv.port), timeout=10)
        s.sendall(b"GET /thing HTTP/1.1\r\n")  # and never the rest of the head
        t0 = time.monotonic()
        data = b""
        while True:
            chunk = s.recv(65536)  # the server answers, then closes
            if not chunk:
                break
            data += chunk
        s.close()
        took = time.monotonic() - t0
        assert data.startswith(b"HTTP/1.1 408") or data == b"", data[:80]
        assert 0.3 < took < 5, took
