"""Re-replication after a recovery (issue 28, finding 3): a master killed with -9 and restarted,
or a leader killed and replaced by its standby, takes the objects back as the segments
re-register them; re-replication must neither copy what is on its way back nor leave an object
with more replicas than it asked for.

Pool: four segment processes, 400 objects with replica count 2 and checksummed values. After
the recovery has settled (no recovery under way, nothing under-replicated, no repair in flight)
every object has exactly 2 replicas (the status document's replica total is 2 x 400 while none
is short) and reads back its bytes.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.support.auth import headers
from tests.support.services import wait_until
from tests.support.store_procs import spawn_master, spawn_segment, spawn_worker

pytestmark = [pytest.mark.fault, pytest.mark.timeout(180)]
N = 400
SIZE = 20000
SEGMENTS = 4


def get(admin: int, path: str) -> dict:
    try:
        return httpx.get(f"http://127.0.0.1:{admin}{path}", timeout=2, trust_env=False,
                         headers=headers()).json()
    except (httpx.HTTPError, ValueError):
        return {}


def settled(admin: int) -> dict | None:
    """The object counts once the recovery and its repairs are over, else None."""
    if get(admin, "/ha_status").get("recovering", True):
        return None
    objs = get(admin, "/status").get("objects", {})
    if objs.get("objects") != N or objs.get("under_replicated") != 0 or \
            objs.get("repairs_pending", 0) != 0:
        return None
    return objs


def fill(addr: str, procs: list) -> tuple:
    procs += [spawn_segment(addr, "64MiB") for _ in range(SEGMENTS)]
    w = spawn_worker(addr, "--timeout", "5", "--checksum")
    procs.append(w)
    keys = [f"r{i}" for i in range(N)]
    put = w.ask(json.dumps({"op": "put", "keys": keys, "size": SIZE, "replicas": 2}), 60)
    assert set(put["result"]) == {0}
    return w, keys


def pinged_twice_since(admin: int, t0: float) -> bool:
    """Every segment has heartbeat twice since ``t0`` (pings come once a second): a repair
    task planned before ``t0`` has been handed out with a ping and reported meanwhile."""
    now = time.time()
    rows = get(admin, "/status").get("segments", [])
    return len(rows) == SEGMENTS and all(
        r["heartbeat_age_s"] is not None and now - r["heartbeat_age_s"] > t0 + 1.2 for r in rows)


def assert_exactly_two_replicas(admin: int, w, keys: list[str]) -> None:
    try:
        wait_until(lambda: settled(admin) is not None, 60, "recovery and repairs settled")
    except Exception:  # say what did not settle (a CI run timed out here once)
        print("ha_status:", get(admin, "/ha_status"), "objects:", get(admin, "/status").get("objects"))
        raise
    t0 = time.time()
    wait_until(lambda: pinged_twice_since(admin, t0), 20, "two heartbeats of every segment")
    wait_until(lambda: settled(admin) is not None, 30, "repairs settled")
    objs = settled(admin) or get(admin, "/status")["objects"]
    print("settled:", objs)
    # none short and 2 x N in all: every object holds exactly two
    assert objs["replicas"] == 2 * N, objs
    verdict = w.ask(json.dumps({"op": "check", "keys": {k: SIZE for k in keys}}), 60)["result"]
    assert {k: v for k, v in verdict.items() if v != "ok"} == {}


def test_after_a_kill9_restart_every_object_has_exactly_its_replicas():
    m = spawn_master("--client-ttl", "10")
    procs = [m]
    try:
        addr, port = m.info["master"], m.info["master"].rsplit(":", 1)[1]
        w, keys = fill(addr, procs)
        m.kill()
        m2 = spawn_master("--client-ttl", "10", "--port", port)
        procs.append(m2)
        assert_exactly_two_replicas(m2.info["admin_port"], w, keys)
    finally:
        for p in reversed(procs):
            p.stop()


def test_after_an_ha_failover_every_object_has_exactly_its_replicas(etcd_url):
    cluster = f"r{time.monotonic_ns()}"
    masters = [spawn_master("--ha", etcd_url, "--cluster-id", cluster, "--ha-lease-ttl", "2",
                            "--client-ttl", "10") for _ in range(2)]
    procs = list(masters)
    try:
        admins = [m.info["admin_port"] for m in masters]
        wait_until(lambda: sum(get(a, "/ha_status").get("role") == "leader" for a in admins) == 1,
                   20, "a leader")
        lead = next(i for i, a in enumerate(admins) if get(a, "/ha_status")["role"] == "leader")
        w, keys = fill(f"{etcd_url}/{cluster}", procs)
        # the leader publishes the segments it serves (the standby waits for them): let it
        wait_until(lambda: settled(admins[lead]) is not None, 20, "the pool settled")
        masters[lead].kill()
        standby = admins[1 - lead]
        wait_until(lambda: get(standby, "/ha_status").get("role") == "leader", 15,
                   "the standby leads")
        assert_exactly_two_replicas(standby, w, keys)
    finally:
        for p in reversed(procs):
            p.stop()
