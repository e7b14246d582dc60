"""`kvplane status` and `kvplane top` against a running cluster: a real master, two segment
processes, a client process and a conductor. After a known sequence of puts, gets, removes and
evictions the master forced, the status document's numbers equal the sequence and the master's
own views (/metrics, /segments, /get_all_keys)."""

import json
import signal
import subprocess

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvplane.common.auth import client_token
from kvplane.common.procs import Proc
from kvplane.store.client.client import FENCE_WORD
from tests.support.auth import headers
from tests.support.services import wait_until
from tests.support.store_procs import CLI, spawn_master, spawn_segment, spawn_worker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
KIB = 1024


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def status_json(admin: str, *extra: str) -> dict:
    out = run_cli("status", "--admin", admin, "--json", *extra)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def scrape(admin: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{admin}/metrics/", headers=headers(), timeout=10, trust_env=False).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.fixture(scope="module")
def cluster():
    master = spawn_master("--lease-ttl", "0.3", "--high-watermark", "0.5", "--evict-ratio", "0.1",
                          "--kv-events-port", "0")
    procs = [master]
    try:
        conductor = Proc([*CLI, "conductor", "--port", "0"], stop_signal=signal.SIGINT)
        procs.append(conductor)
        cond = conductor.info["conductor"]
        r = httpx.post(f"{cond}/register", headers=headers(), trust_env=False, timeout=10, json={
            "instance_id": "pool", "type": "kvplane", "modelname": "m", "block_size": 16,
            "endpoint": master.info["kv_events"], "replay_endpoint": master.info["kv_events_replay"],
            "token": client_token()})
        assert r.status_code == 200, r.text
        segs = [spawn_segment(master.info["master"], "4MiB") for _ in range(2)]
        procs += segs
        worker = spawn_worker(master.info["master"])
        procs.append(worker)
        yield {"admin": f"http://127.0.0.1:{master.info['admin_port']}", "conductor": cond,
               "segments": sorted(s.info["segment"] for s in segs), "worker": worker}
    finally:
        for p in reversed(procs):
            p.stop()


def keys(prefix: str, n: int) -> list[str]:
    return [f"m@0@{prefix}{i:04x}" for i in range(n)]  # hex tails: published as KV events


def test_status_matches_the_masters_state(cluster):
    admin, worker = cluster["admin"], cluster["worker"]
    doc = status_json(admin)
    assert sorted(s["name"] for s in doc["segments"]) == cluster["segments"]
    seg = (4 << 20) - FENCE_WORD  # a 4 MiB segment but its fence word (issue 10)
    assert all(s["status"] == "alive" and s["capacity_bytes"] == seg for s in doc["segments"])
    assert doc["capacity_bytes"] == 2 * seg and doc["evictions"]["total"] == 0

    first = keys("0xa", 8)  # 1 MiB of 8: under the 50 % watermark
    assert worker.ask(json.dumps({"op": "put", "keys": first, "size": 128 * KIB}))["result"] == [0] * 8
    got = worker.ask(json.dumps({"op": "check", "keys": {k: 128 * KIB for k in first}}))["result"]
    assert set(got.values()) == {"ok"}
    assert worker.ask(json.dumps({"op": "remove", "keys": first[:3]}))["result"] == [0] * 3
    doc = status_json(admin)
    assert doc["ops"]["total"] == {"put": 8, "get": 8, "exist": 0, "remove": 3}
    assert doc["ops"]["per_s"]["put"] > 0 and doc["ops"]["per_s"]["get"] > 0  # within 10 s
    assert doc["objects"]["objects"] == 5 and doc["objects"]["replicas"] == 5
    assert doc["objects"]["bytes"] == 5 * 128 * KIB and doc["evictions"]["total"] == 0

    second = keys("0xb", 24)  # 6 MiB more: past the watermark, the master evicts
    put = 0
    for i in range(0, 24, 8):
        codes = worker.ask(json.dumps({"op": "put", "keys": second[i:i + 8], "size": 256 * KIB}))["result"]
        put += codes.count(0)
    assert put >= 16, "the pool should take most of these puts"

    def settled():
        d = status_json(admin)
        return d["evictions"]["total"] > 0 and d["used_bytes"] <= 0.5 * d["capacity_bytes"]
    wait_until(settled, 60, "evictions down to the watermark")

    def agree():  # status and the master's own views, read back to back, say the same
        d = status_json(admin)
        m = scrape(admin)
        segs = httpx.get(f"{admin}/segments", headers=headers(), trust_env=False, timeout=10).json()
        listed = httpx.get(f"{admin}/get_all_keys", headers=headers(), trust_env=False, timeout=10).json()
        checks = [
            d["evictions"]["total"] == m[("master_evicted_key_count_total", ())],
            d["objects"]["objects"] == len(listed) == 5 + put - d["evictions"]["total"],
            d["objects"]["objects"] + d["objects"]["pending_puts"] == m[("master_key_count", ())],
            d["used_bytes"] == sum(s["allocator_used_bytes"] for s in segs)
            == m[("master_allocated_bytes", ())],
            {s["name"]: s["used_bytes"] for s in d["segments"]}
            == {s["segment_name"]: s["allocator_used_bytes"] for s in segs},
            all(d["ops"]["rpc_calls"][meth] == m[("master_rpc_requests_total", (("method", meth),))]
                for meth in ("put_start", "put_end", "get_replicas", "remove")),
        ]
        agree.last = (d, checks)
        return all(checks)
    wait_until(agree, 30, "status to agree with the master's metrics")
    d = agree.last[0]
    assert d["ops"]["total"] == {"put": 32, "get": 8, "exist": 0, "remove": 3}
    assert sum(s["replicas"] for s in d["segments"]) == d["objects"]["replicas"] == d["objects"]["objects"]
    assert d["evictions"]["total"] == 5 + put - d["objects"]["objects"]

    # the conductor: the pool's stream, the events it applied, and the blocks the pool holds
    def indexed():
        c = status_json(admin, "--conductor", cluster["conductor"])["conductor"]
        pool = [i for i in c["instances"] if i["instance_id"] == "pool"]
        indexed.last = pool
        return len(pool) == 1 and pool[0]["blocks"]["CPU"] == d["objects"]["objects"]
    wait_until(indexed, 30, "the conductor to index the pool's objects")
    pool = indexed.last[0]
    assert pool["events"] >= 3 and pool["batches"] >= 3  # stored, removed, stored+evicted batches
    assert pool["events"] >= pool["batches"]


def test_status_report_is_readable(cluster):
    out = run_cli("status", "--admin", cluster["admin"], "--conductor", cluster["conductor"])
    assert out.returncode == 0, out.stderr
    for name in cluster["segments"]:
        assert name in out.stdout, out.stdout
    for word in ("master", "pool", "objects", "evictions", "ops/s", "alive", "conductor"):
        assert word in out.stdout, word


def test_top_refreshes_and_sorts(cluster):
    out = run_cli("top", "--admin", cluster["admin"], "--iterations", "2", "--interval", "0.2",
                  "--sort", "name")
    assert out.returncode == 0, out.stderr
    frames = out.stdout.split("kvplane top · refresh ")
    assert [f.split(" ", 1)[0] for f in frames[1:]] == ["1", "2"]
    for frame in frames[1:]:
        a, b = cluster["segments"]
        assert a in frame and b in frame and frame.index(a) < frame.index(b)  # sorted by name
        assert "sorted by name" in frame


def test_status_refuses_bad_token_and_dead_master(cluster):
    out = run_cli("status", "--admin", cluster["admin"], "--token", "wrong")
    assert out.returncode == 1 and "refused the token" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    out = run_cli("status", "--admin", "http://127.0.0.1:1", "--timeout", "2")
    assert out.returncode == 1 and "unreachable" in out.stderr
    out = run_cli("top", "--admin", cluster["admin"], "--sort", "bogus")
    assert out.returncode == 2
