"""Store under faults: dead segments, dead clients, a restarted master, pressure, hostile input."""

import json
import socket
import struct

import httpx
import numpy as np
import pytest

from kvplane.common.errors import InvalidArgument, ProtocolError
from kvplane.common.rpc import RpcClient
from kvplane.store.client.client import StoreClient
from kvplane.store.errors import InvalidKey
from kvplane.store.master.config import MasterConfig
from kvplane.store.master.server import MasterServer
from kvplane.store.types import KeysReq, PutStartReq, ReplicateConfig, ResultsRep
from tests.support.auth import headers
from tests.support.services import wait_until
from tests.support.store_client_proc import value_of
from tests.support.store_procs import spawn_master, spawn_segment, spawn_worker

pytestmark = [pytest.mark.fault, pytest.mark.timeout(120)]
KB = 1024


def ask(proc, timeout=90, **cmd):
    return proc.ask(json.dumps(cmd), timeout=timeout)["result"]


def rpc_count(admin_port, method):
    text = httpx.get(f"http://127.0.0.1:{admin_port}/metrics/", headers=headers()).text
    for line in text.splitlines():
        if line.startswith(f'master_rpc_requests_total{{method="{method}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_kill9_segment_with_one_of_two_replicas_under_read_load():
    with spawn_master("--client-ttl", "30") as m:
        addr, admin = m.info["master"], m.info["admin_port"]
        with spawn_segment(addr, "32MiB") as victim, spawn_segment(addr, "32MiB"), \
                spawn_worker(addr, "--protocol", "tcp", "--timeout", "3") as reader:
            with StoreClient(master=addr, protocol="tcp") as w:
                keys = {f"rep-{i}": 64 * KB for i in range(40)}
                vals = [value_of(k, 64 * KB).tobytes() for k in keys]
                assert w.put_batch(list(keys), vals, ReplicateConfig(replica_num=2)) == [None] * 40
            before = rpc_count(admin, "get_replicas")
            reader.popen.stdin.write(json.dumps({"op": "read_loop", "keys": keys, "seconds": 4}) + "\n")
            reader.popen.stdin.flush()
            # every key's first get is a lookup (later ones may be held reads, with none)
            wait_until(lambda: rpc_count(admin, "get_replicas") >= before + 40, 20, "reads under way")
            victim.kill()
            res = json.loads(reader.popen.stdout.readline())["result"]
            assert res["ok"] > 100
            assert res["corrupt"] == 0 and res["missing"] == 0  # every get returned the right bytes
            assert res["max_latency_s"] < 3.5  # failover within the transfer timeout, no hang


def test_dead_client_segments_go_within_ttl():
    with spawn_master("--client-ttl", "1.5") as m:
        addr, admin = m.info["master"], m.info["admin_port"]
        seg = spawn_segment(addr, "16MiB")
        name = seg.info["segment"]
        url = f"http://127.0.0.1:{admin}/get_all_segments"
        assert name in httpx.get(url, headers=headers()).json()
        seg.kill()
        wait_until(lambda: name not in httpx.get(url, headers=headers()).json(), 6,
                   "segment unmount after TTL")
        seg.stop()


def test_master_restart_clients_remount_without_hanging():
    m = spawn_master()
    addr = m.info["master"]
    port = addr.rsplit(":", 1)[1]
    with spawn_worker(addr, "--segment-mb", "16") as w:
        assert ask(w, op="put", keys=["before"], size=1000) == [0]
        m.kill()
        m.stop()
        assert ask(w, op="health", timeout=20) in ("Unavailable", "Timeout")  # answered promptly
        m = spawn_master("--port", port)  # back on the same address, empty
        try:
            wait_until(lambda: w.ask(json.dumps({"op": "health"}), 10)["remounts"] >= 1, 15,
                       "remount after master restart")
            assert ask(w, op="put", keys=["after"], size=1000) == [0]
            assert ask(w, op="check", keys={"after": 1000}) == {"after": "ok"}
        finally:
            m.stop()


def test_four_processes_ten_thousand_mixed_ops_lose_nothing():
    with spawn_master() as m:
        addr = m.info["master"]
        with spawn_segment(addr, "256MiB"), spawn_segment(addr, "256MiB"):
            workers = [spawn_worker(addr, *(["--protocol", "tcp"] if i % 2 else [])) for i in range(4)]
            try:
                for i, w in enumerate(workers):
                    w.popen.stdin.write(json.dumps({"op": "mixed", "n": 10_000, "prefix": f"m{i}",
                                                    "seed": i}) + "\n")
                    w.popen.stdin.flush()
                results = [json.loads(w.popen.stdout.readline())["result"] for w in workers]
                for r in results:
                    assert r["corrupt"] == 0 and r["lost"] == 0 and r["errors"] == 0, r
                    assert r["put"] > 4000 and r["get"] > 3000
                live = {k: s for r in results for k, s in r["live"].items()}
                verdict = ask(workers[0], op="check", keys=live)
                assert set(verdict.values()) == {"ok"}  # every acknowledged object, byte-exact
            finally:
                for w in workers:
                    w.stop()


def test_eviction_under_pressure_spares_leased_and_pinned():
    cfg = MasterConfig(high_watermark=0.8, evict_ratio=0.1, lease_ttl=30.0)
    with MasterServer(cfg, admin_port=None) as m:
        addr = f"127.0.0.1:{m.port}"
        with StoreClient(master=addr, global_segment_size=4 << 20) as seg, \
                StoreClient(master=addr, protocol="tcp") as c:
            pinned = [f"pin-{i}" for i in range(8)]
            assert c.put_batch(pinned, [value_of(k, 64 * KB).tobytes() for k in pinned],
                               ReplicateConfig(with_hard_pin=True)) == [None] * 8
            leased = [f"lease-{i}" for i in range(8)]
            c.put_batch(leased, [value_of(k, 64 * KB).tobytes() for k in leased])
            c.get_batch(leased)  # takes 30 s leases
            for i in range(300):  # ~19 MiB through a 4 MiB pool
                c.put(f"fill-{i}", value_of(f"fill-{i}", 64 * KB).tobytes())
            m.tick()
            assert m.state.evicted > 0
            for k in pinned + leased:
                got = c.get(k)  # raises if it was evicted
                assert np.array_equal(np.frombuffer(got, np.uint8), value_of(k, 64 * KB))
            seg.health_check()


def test_master_survives_hostile_requests():
    with MasterServer(admin_port=None) as m:
        addr = f"127.0.0.1:{m.port}"
        with StoreClient(master=addr, global_segment_size=1 << 20) as c:
            with pytest.raises(InvalidKey):
                c.put("x" * 5000, b"v")  # oversized key
            assert c.put_batch(["big"], [b"v"]) == [None]
            huge = c.rpc.call("put_start", PutStartReq("z", ["h"], [1 << 41], ReplicateConfig()),
                              ResultsRep)
            assert huge.results[0].code < 0  # oversized value
            with pytest.raises(InvalidArgument):
                c.rpc.call("no_such_op", KeysReq("z", ["a"]), int)
            with pytest.raises(ProtocolError):
                c.rpc.call("get_replicas", {"bogus": 1}, ResultsRep)  # malformed body
            for junk in (b"\x00\x00\x00\x05\xc1\xc1\xc1\xc1\xc1", struct.pack("<I", 1 << 30),
                         struct.pack("<I", 100) + b"trunc"):
                with socket.create_connection(("127.0.0.1", m.port), timeout=5) as s:
                    try:
                        s.sendall(junk)
                        s.shutdown(socket.SHUT_WR)  # the master may have closed on us already
                        assert s.recv(100) == b""
                    except (ConnectionResetError, BrokenPipeError, OSError):
                        pass
            with RpcClient(addr) as r:
                got = r.call("get_replicas", KeysReq("z", ["big"]), ResultsRep)
                assert got.results[0].code == 0
            assert c.get("big") == b"v"
