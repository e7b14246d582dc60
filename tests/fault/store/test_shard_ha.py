"""A sharded pool with high availability per shard: two shards, each a leader and a standby on
etcd; the leader of one shard is killed (-9) under a 3-client put/get load (replicas=2,
checksummed values). docs/store.md, "Sharded metadata".

What must hold: the killed shard's standby leads within 5 s; the other shard keeps serving
meanwhile (its puts acknowledged within a second each); no acknowledged object is lost on any
shard, no wrong bytes, no client call past its deadline (+ MARGIN), the clients finish without
a restart.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from kvplane.common.procs import wait_for_line
from kvplane.store.client.client import StoreClient
from kvplane.store.shard.slots import owners, slot_of
from kvplane.testing.needs import requires
from tests.support.auth import headers
from tests.support.services import start_etcd, wait_until
from tests.support.store_procs import not_read_back, spawn_master, spawn_segment, spawn_worker

pytestmark = [pytest.mark.fault, pytest.mark.timeout(180)]
TIMEOUT = 5.0
MARGIN = 1.0
RUN = 10.0  # seconds of load; a leader dies about 3 s in
LEASE = "2"


def objects(admin_port: int) -> int:
    """Complete objects the pool holds (any shard's /status answers for every shard)."""
    try:
        return int(httpx.get(f"http://127.0.0.1:{admin_port}/status", timeout=2,
                             trust_env=False, headers=headers()).json()["objects"]["objects"])
    except (httpx.HTTPError, KeyError, ValueError):
        return 0


def role(admin_port: int) -> str:
    try:
        return httpx.get(f"http://127.0.0.1:{admin_port}/ha_status", timeout=2,
                         trust_env=False, headers=headers()).json().get("role", "")
    except httpx.HTTPError:
        return ""


@pytest.fixture
def etcd(tmp_path):
    requires("etcd")
    svc = start_etcd(str(tmp_path / "etcd"))
    yield svc
    svc.stop()


def test_a_shard_leader_killed_under_load_others_serve_nothing_lost(etcd):
    cluster = f"sh{time.monotonic_ns()}"
    masters = {(i, r): spawn_master("--ha", etcd.url, "--cluster-id", cluster, "--shard",
                                    f"{i}/2", "--ha-lease-ttl", LEASE, "--client-ttl", "10")
               for i in (0, 1) for r in (0, 1)}
    procs = list(masters.values())
    try:
        admin = {k: m.info["admin_port"] for k, m in masters.items()}
        for i in (0, 1):
            wait_until(lambda i=i: sum(role(admin[i, r]) == "leader" for r in (0, 1)) == 1, 20,
                       f"a leader of shard {i}")
        lead = {i: next(r for r in (0, 1) if role(admin[i, r]) == "leader") for i in (0, 1)}
        addr = f"{etcd.url}/{cluster}-s0"  # any shard's address: its map names the others
        procs += [spawn_segment(addr, "128MiB") for _ in range(2)]
        workers = [spawn_worker(addr, "--timeout", str(TIMEOUT), "--checksum",
                                *(["--protocol", "tcp"] if i % 2 else [])) for i in range(3)]
        procs += workers
        for i, w in enumerate(workers):
            w.popen.stdin.write(json.dumps({"op": "churn", "seconds": RUN, "prefix": f"w{i}",
                                            "seed": i, "replicas": 2, "keep": 150}) + "\n")
            w.popen.stdin.flush()
        with StoreClient(master=addr, protocol="tcp", timeout=TIMEOUT) as probe:
            own = owners(probe.rpc.map)
            zero = [k for k in (f"probe-{n}" for n in range(400)) if own[slot_of(k)] == 0]
            # the churn is under way on both shards before shard 1's leader dies
            wait_until(lambda: objects(admin[1, lead[1]]) >= 200, 20, "the workers' objects")
            masters[1, lead[1]].kill()  # shard 1 loses its leader
            killed = time.monotonic()
            slow = []
            for k in zero[:40]:  # shard 0 keeps acknowledging meanwhile
                t = time.monotonic()
                probe.put(k, b"p" * 4096)
                slow += [time.monotonic() - t] if time.monotonic() - t > 1.0 else []
            standby = admin[1, 1 - lead[1]]
            wait_until(lambda: role(standby) == "leader", 10, "shard 1's standby leads")
            failover = time.monotonic() - killed
            assert failover <= 5.0 and slow == [], (failover, slow)
            assert probe.get_batch(zero[:40]) == [b"p" * 4096] * 40
        results = [json.loads(wait_for_line(w.popen.stdout, RUN + 60)) for w in workers]
        lost: dict[str, str] = {}
        for w, r in zip(workers, results):
            res = r["result"]
            summary = {k: v for k, v in res.items() if k != "live"}
            assert res["corrupt"] == 0 and res["corrupt_reads"] == 0, summary
            assert res["max_call_s"] <= TIMEOUT + MARGIN, summary
            assert res["put"] > 20 and res["get"] > 20, summary
            live = res["live"]
            assert {own[slot_of(k)] for k in live} == {0, 1}  # both shards held them
            lost.update(not_read_back(w, live))
        assert lost == {}
        print(f"failover {failover:.2f} s; acknowledged objects checked: "
              f"{sum(len(r['result']['live']) for r in results)}; lost 0")
    finally:
        for p in reversed(procs):
            p.stop()
