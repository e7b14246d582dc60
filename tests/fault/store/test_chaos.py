"""Chaos (issue 15): master + 3 segments + 2 clients (tcp and shared memory), replicas=2,
values any process can verify (``value_of``; the tcp client also with store checksums on, the
shared-memory one with the defaults); one segment stalls for (timeout + 2 s), then another is killed with -9.

What must hold: no wrong bytes, no acknowledged object lost, every object back to 2 replicas
within 30 s of the kill, no call past its deadline (+ MARGIN). The schedule is timed (a stall
has a length), every wait for an outcome polls a condition with a deadline.
"""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from kvplane.common.procs import wait_for_line
from tests.support.auth import headers
from tests.support.services import wait_until
from tests.support.store_procs import not_read_back, spawn_master, spawn_segment, spawn_worker

pytestmark = [pytest.mark.fault, pytest.mark.timeout(150)]
TIMEOUT = 5.0  # the clients' call deadline (the default)
MARGIN = 1.0  # scheduling slack allowed past a deadline on a loaded 2-core box
STALL = TIMEOUT + 2.0
RUN = 24.0  # seconds of load: 3 before the stall, the stall, 2 after, then the kill and its TTL


def metric(admin_port, name):
    for line in httpx.get(f"http://127.0.0.1:{admin_port}/metrics/", headers=headers()).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def replica_counts(admin_port, keys):
    with httpx.Client(base_url=f"http://127.0.0.1:{admin_port}", headers=headers()) as http:
        got = [http.get("/query_key", params={"key": k}) for k in keys]
    return [len(g.json()["data"]) if g.status_code == 200 else 0 for g in got]


def test_stall_one_segment_kill_another_lose_nothing():
    with spawn_master("--client-ttl", "10") as m:
        addr, admin = m.info["master"], m.info["admin_port"]
        segs = [spawn_segment(addr, "64MiB") for _ in range(3)]
        workers = [spawn_worker(addr, "--protocol", "tcp", "--timeout", str(TIMEOUT), "--checksum"),
                   spawn_worker(addr, "--timeout", str(TIMEOUT))]  # auto: shared memory, defaults
        try:
            for i, w in enumerate(workers):
                w.popen.stdin.write(json.dumps({"op": "churn", "seconds": RUN, "prefix": f"c{i}",
                                                "seed": i, "replicas": 2}) + "\n")
                w.popen.stdin.flush()
            start = time.monotonic()
            wait_until(lambda: (metric(admin, "master_key_count") or 0) > 50, 20, "load under way")
            stalled, killed = segs[0], segs[1]
            stalled.signal(signal.SIGSTOP)
            time.sleep(STALL)  # the fault itself: a stall of this length
            stalled.signal(signal.SIGCONT)
            wait_until(lambda: time.monotonic() - start > 3 + STALL + 2, 10, "2 s after the stall")
            killed.kill()
            killed_at = time.monotonic()
            results = [json.loads(wait_for_line(w.popen.stdout, RUN + 60))["result"] for w in workers]
            for r in results:
                summary = {k: v for k, v in r.items() if k != "live"}
                assert r["corrupt"] == 0, summary  # never another object's bytes
                assert r["max_call_s"] <= TIMEOUT + MARGIN, summary
                assert r["put"] > 50 and r["get"] > 50, summary
            # the killed segment goes after its TTL; its objects get their second replica back
            wait_until(lambda: metric(admin, "master_mounted_segments") == 2, 30, "unmount")
            wait_until(lambda: metric(admin, "master_under_replicated_keys") == 0,
                       max(1.0, 30 - (time.monotonic() - killed_at)), "re-replication")
            for w, r in zip(workers, results):
                live = r["live"]
                bad = not_read_back(w, live)
                assert not bad, bad
                sample = sorted(live)[::max(1, len(live) // 40)]  # the gauge counted them all
                assert set(replica_counts(admin, sample)) == {2}
        finally:
            for p in workers + segs:
                p.stop()
