"""Store high availability across simulated hosts (issue 10; the netns bed, docs/testbed.md):
masters, segments and clients each on their own host, etcd on the bed's gateway.

* The leader's host is cut off from etcd and from the clients for 10 s while the other master
  is elected: the old leader acknowledges nothing once its lease has ended (a probe on its own
  host keeps asking it for put allocations), the clients carry on with the new leader, and
  after healing nothing acknowledged is lost, no byte is wrong, and the old leader rejoins as a
  standby.
* A segment's host is cut off, then healed: its objects are served from their other replica
  meanwhile, and it remounts without an operator.
"""

from __future__ import annotations

import json
import sys
import time

import httpx
import pytest

from kvplane.common.procs import wait_for_line
from tests.support.auth import headers
from tests.support.services import start_etcd, wait_until
from tests.support.store_procs import CLI

pytestmark = [pytest.mark.fault, pytest.mark.requires("etcd"), pytest.mark.timeout(240)]
TIMEOUT = 5.0  # the clients' call deadline
MARGIN = 1.0  # scheduling slack past a deadline on a loaded 2-core box
LEASE = 2.0  # seconds of the leader lease
CUT = 10.0  # seconds a host stays cut off


def get(url: str, path: str) -> dict:
    try:
        return httpx.get(url + path, timeout=1.0, trust_env=False, headers=headers()).json()
    except (httpx.HTTPError, ValueError):
        return {}


def metric(url: str, name: str) -> float | None:
    try:
        text = httpx.get(url + "/metrics/", timeout=1.0, trust_env=False, headers=headers()).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def master(host, etcd_url: str, cluster: str):
    p = host.spawn([*CLI, "master", "--host", host.ip, "--port", "0", "--admin-port", "0",
                    "--ha", etcd_url, "--cluster-id", cluster, "--ha-lease-ttl", str(int(LEASE)),
                    "--client-ttl", "4"])
    p.url = f"http://{host.ip}:{p.info['admin_port']}"
    p.rpc = f"{host.ip}:{p.info['master'].rsplit(':', 1)[1]}"
    return p


def segment(host, addr: str):
    return host.spawn([*CLI, "segment", "--master", addr, "--host", host.ip, "--size", "64MiB"])


def worker(host, addr: str):
    return host.spawn([sys.executable, "-m", "tests.support.store_client_proc", "--master",
                       addr, "--host", host.ip, "--timeout", str(TIMEOUT), "--checksum"])


def churn(workers, seconds: float) -> None:
    for i, w in enumerate(workers):
        w.popen.stdin.write(json.dumps({"op": "churn", "seconds": seconds, "prefix": f"w{i}",
                                        "seed": i, "replicas": 2, "keep": 200}) + "\n")
        w.popen.stdin.flush()


def finish(workers, seconds: float) -> list[dict]:
    results = [json.loads(wait_for_line(w.popen.stdout, seconds))["result"] for w in workers]
    for r in results:
        summary = {k: v for k, v in r.items() if k != "live"}
        assert r["corrupt"] == 0 and r["corrupt_reads"] == 0, summary
        assert r["max_call_s"] <= TIMEOUT + MARGIN, summary
        assert r["put"] > 10 and r["get"] > 10, summary
    for w, r in zip(workers, results):
        verdict = w.ask(json.dumps({"op": "check", "keys": r["live"]}), 60)["result"]
        assert {k: v for k, v in verdict.items() if v != "ok"} == {}
    return results


def cluster_up(bed, data_dir, hosts_segments: list[str]):
    etcd = start_etcd(str(data_dir / "etcd"), host=bed.gateway)
    cluster = f"bed{bed.tag}"
    masters = [master(bed[h], etcd.url, cluster) for h in ("m1", "m2")]
    wait_until(lambda: sum(get(m.url, "/ha_status").get("role") == "leader" for m in masters)
               == 1, 20, "a leader")
    addr = f"{etcd.url}/{cluster}"
    segs = [segment(bed[h], addr) for h in hosts_segments]
    return etcd, masters, addr, segs


def test_partitioned_leader_stops_acknowledging_and_rejoins_as_standby(netbed, tmp_path):
    bed = netbed(["m1", "m2", "s1", "s2", "c1"])
    etcd, masters, addr, segs = cluster_up(bed, tmp_path, ["s1", "s2"])
    procs = [*masters, *segs]
    try:
        old = next(m for m in masters if get(m.url, "/ha_status")["role"] == "leader")
        new = next(m for m in masters if m is not old)
        old_host = bed["m1"] if old is masters[0] else bed["m2"]
        workers = [worker(bed["c1"], addr) for _ in range(2)]
        procs += workers
        run = 3 + CUT + 10
        churn(workers, run)
        wait_until(lambda: get(old.url, "/health").get("keys", 0) > 50, 20, "load under way")
        probe = old_host.spawn([sys.executable, "-m", "tests.support.master_probe",
                                "--master", old.rpc, "--seconds", str(CUT)])
        procs.append(probe)
        term = get(old.url, "/ha_status")["term"]
        bed.partition(old_host.name)
        cut_at = time.monotonic()
        wait_until(lambda: get(new.url, "/ha_status").get("role") == "leader", CUT,
                   "the other master leads")
        took = time.monotonic() - cut_at
        seen = json.loads(wait_for_line(probe.popen.stdout, CUT + 10))
        bed.heal(old_host.name)
        # it answered while leading, then refused (NotLeader) on its own host: never after its
        # lease, which it counts from before its last keepalive (before the cut)
        assert seen["answered"] > 0 and seen["not_leader"] > 0, seen
        assert seen["last_answer"] <= cut_at + LEASE, (seen, cut_at)
        assert get(new.url, "/ha_status")["term"] > term
        # a standby once more, following the new leader (it reads the leader key again)
        wait_until(lambda: (get(old.url, "/ha_status").get("role"),
                            get(old.url, "/ha_status").get("leader")) == ("standby", new.rpc),
                   15, "the old leader is a standby of the new one")
        assert get(new.url, "/ha_status")["role"] == "leader"
        results = finish(workers, run + 60)
        print(f"new leader after {took:.2f} s; old leader's last answer "
              f"{seen['last_answer'] - cut_at:+.2f} s from the cut; acknowledged objects "
              f"checked: {sum(len(r['live']) for r in results)}; lost 0")
    finally:
        for p in reversed(procs):
            p.stop()
        etcd.stop()


def test_partitioned_segment_is_read_elsewhere_and_remounts(netbed, tmp_path):
    bed = netbed(["m1", "m2", "s1", "s2", "s3", "c1"])
    etcd, masters, addr, segs = cluster_up(bed, tmp_path, ["s1", "s2", "s3"])
    procs = [*masters, *segs]
    try:
        lead = next(m for m in masters if get(m.url, "/ha_status")["role"] == "leader")
        w = worker(bed["c1"], addr)
        procs.append(w)
        keys = [f"k{i}" for i in range(120)]
        put = w.ask(json.dumps({"op": "put", "keys": keys, "size": 20000, "replicas": 2}), 60)
        assert set(put["result"]) == {0}
        bed.partition("s1")
        t0 = time.monotonic()
        # read everything while s1 is cut off: each object has a replica elsewhere
        verdict = w.ask(json.dumps({"op": "check", "keys": {k: 20000 for k in keys}}), 120)
        assert {k: v for k, v in verdict["result"].items() if v != "ok"} == {}
        wait_until(lambda: metric(lead.url, "master_mounted_segments") == 2, 15,
                   "the cut segment is dropped after its TTL")
        time.sleep(max(0.0, CUT - (time.monotonic() - t0)))  # the fault: a cut of this length
        bed.heal("s1")
        wait_until(lambda: metric(lead.url, "master_mounted_segments") == 3, 20,
                   "the healed segment remounts on its own")
        wait_until(lambda: metric(lead.url, "master_under_replicated_keys") == 0, 30,
                   "back to 2 replicas")
        verdict = w.ask(json.dumps({"op": "check", "keys": {k: 20000 for k in keys}}), 60)
        assert {k: v for k, v in verdict["result"].items() if v != "ok"} == {}
    finally:
        for p in reversed(procs):
            p.stop()
        etcd.stop()
