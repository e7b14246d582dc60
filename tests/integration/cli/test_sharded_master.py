"""``kvplane master --shards N`` and ``--shard I/N``, ``kvplane status`` of a sharded pool,
``kvplane shards``, and a shard killed (-9) and restarted after slots moved."""

import json
import signal
import subprocess

import pytest
from rich.console import Console

from kvplane.bench.services import CLI, spawn_segment
from kvplane.cli.status import collect, view
from kvplane.common.auth import client_token
from kvplane.common.procs import Proc, free_port, wait_until
from kvplane.store.client.client import StoreClient
from kvplane.store.shard.slots import owners, slot_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def cli(*args: str) -> str:
    out = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_shards_in_one_command_serve_and_report_as_one_pool():
    with Proc([*CLI, "master", "--shards", "2", "--port", "0", "--admin-port", "0"],
              stop_signal=signal.SIGTERM) as m:
        assert [s["shard"] for s in m.info["shards"]] == [0, 1]
        with spawn_segment(m.info["master"], "64MiB"), \
                StoreClient(master=m.info["shards"][1]["master"], protocol="tcp") as c:
            keys = [f"cli-{i}" for i in range(100)]
            assert c.put_batch(keys, [b"v" * 1000] * 100) == [None] * 100
            admin = f"http://127.0.0.1:{m.info['admin_port']}"
            doc = json.loads(cli("status", "--admin", admin, "--json"))
            assert doc["objects"]["objects"] == 100 and len(doc["masters"]) == 2
            assert sum(s["objects"] for s in doc["shard"]["shards"]) == 100
            console = Console(width=160, record=True)  # what kvplane status and top print
            console.print(view(doc))
            assert "map v1: 0 " in console.export_text()
            report = json.loads(cli("shards", "move", "0-999", "--to", "1",
                                    "--master", m.info["master"]))
            assert report["slots"] == 1000 and report["aborted"] == 0
            assert c.get_batch(keys) == [b"v" * 1000] * 100


def test_a_shard_killed_and_restarted_after_a_move_serves_by_the_newest_map():
    ports = [free_port(), free_port()]
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)

    def shard(i: int) -> Proc:
        return Proc([*CLI, "master", "--shard", f"{i}/2", "--peers", peers,
                     "--port", str(ports[i]), "--admin-port", "0", "--recovery-grace", "3"],
                    stop_signal=signal.SIGTERM)
    with shard(0) as s0:
        s1 = shard(1)
        try:
            with spawn_segment(s0.info["master"], "64MiB"), \
                    StoreClient(master=s0.info["master"], protocol="tcp") as c:
                keys = [f"rs-{i}" for i in range(300)]
                c.put_batch(keys, [k.encode() * 50 for k in keys])
                own = owners(c.rpc.map)
                moved = [s for s in range(16384) if own[s] == 0][:3000]
                cli("shards", "move", f"{moved[0]}-{moved[-1]}", "--to", "1",
                    "--master", s0.info["master"])
                on_moved = [k for k in keys if slot_of(k) in set(moved)]
                assert on_moved
                s1.kill()  # kill -9: its map of 17 versions is gone with it
                s1.stop()  # (its pipes)
                s1 = shard(1)  # starts from the first map: slots 8192.. only
                # a lone master learns that it restarted from the first segment to remount (a
                # get before that is a miss): wait for the segment's share to be back
                admin = f"http://127.0.0.1:{s1.info['admin_port']}"
                wait_until(lambda: collect(admin, None, client_token(), 5.0)["shard"]["shards"][1]
                           .get("segments"), timeout=20, what="the segment remounted shard 1")
                assert c.get_batch(keys) == [k.encode() * 50 for k in keys]
                got = json.loads(cli("shards", "map", "--master", s1.info["master"]))
                assert got["version"] > 1
        finally:
            s1.stop()
