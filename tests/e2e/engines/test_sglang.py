"""SGLang HiCache on kvplane: its own MooncakeStore (unchanged, through the ``mooncake`` shim) and
kvplane's native backend (``dynamic`` + ``interface_v1``).

Level reached: SGLang's real ``HiCacheController`` with its real storage backends, driven with
CPU tensors (tests.support.sglang_proc); SGLang's server cannot run HiCache on a CPU-only torch
(docs/engines.md). Instance A backs a prefix up with ``write_storage``; instance B, a different
process with an empty host pool, finds it with ``prefetch`` (hit query = ``batch_exists``) and
loads it (``batch_get_v1``); B's KV must equal A's byte for byte.
"""

from __future__ import annotations

import signal

import pytest

from kvplane.store import MasterServer, StoreClient
from tests.support.engine_checks import PAGE, corrupt, pool_hit_tokens, pool_keys, prompt, same_kv
from tests.support.store_procs import spawn_segment

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]
ENGINE = "sglang"
NATIVE = {"backend_name": "kvplane", "module_path": "kvplane.integrations.sglang.hicache",
          "class_name": "KVPlaneHiCacheStorage", "interface_v1": True}


def backend(kind: str, addr: str, protocol: str = "auto") -> dict:
    """(--hicache-storage-backend, --hicache-storage-backend-extra-config) for ``kind``."""
    if kind.startswith("native"):  # native_copying: SGLang's older non-v1 calls
        return {"backend": "dynamic",
                "extra": {**NATIVE, "master_server_address": addr, "protocol": protocol,
                          "interface_v1": kind == "native"}}
    return {"backend": "mooncake",
            "extra": {"master_server_address": addr, "protocol": "tcp",
                      "metadata_server": "P2PHANDSHAKE", "global_segment_size": "0",
                      "local_buffer_size": "16777216"}}


@pytest.mark.parametrize("kind", ["native", "native_copying", "mooncake"])
def test_instance_b_finds_and_loads_a_prefix_bit_exact(kind, engine_pair, pool, conductor,
                                                       tmp_path):
    a, b = engine_pair
    master, addr = pool
    cfg = backend(kind, addr)
    p1, p2, p3 = prompt(4), prompt(4), prompt(4)
    stored = []
    for i, p in enumerate((p1, p2, p3)):
        before = pool_keys(master)
        r = a.call("store", tokens=p, seed=i, out=str(tmp_path / f"a{i}.kv"), **cfg)
        assert r["stored_tokens"] == 4 * PAGE, r
        new = pool_keys(master) - before  # (MooncakeStore also writes a warm-up key)
        r["keys"] = {k for k in new if any(h in k for h in r["page_hashes"])}
        assert len(r["keys"]) == 8, new  # 4 pages x (K, V), in the shared pool
        stored.append(r)
    tb = stored[0]["token_bytes"]

    # the control: one object of p2 gets different bytes; p3 loses its second page
    corrupt(addr, sorted(stored[1]["keys"])[3])
    second = [k for k in stored[2]["keys"] if stored[2]["page_hashes"][1] in k]
    with StoreClient(master=addr, protocol="tcp") as c:
        assert c.batch_remove(second, force=True) == [None, None]

    r1 = b.call("load", tokens=p1, out=str(tmp_path / "b0.kv"), **cfg)
    assert (r1["hit_tokens"], r1["loaded_tokens"]) == (4 * PAGE, 4 * PAGE), r1
    assert same_kv(tmp_path / "a0.kv", tmp_path / "b0.kv", 4 * PAGE, tb)

    r2 = b.call("load", tokens=p2, out=str(tmp_path / "b1.kv"), **cfg)
    assert r2["loaded_tokens"] == 4 * PAGE, r2  # the bytes arrive: nothing in the store noticed
    assert not same_kv(tmp_path / "a1.kv", tmp_path / "b1.kv", 4 * PAGE, tb)  # the check can fail

    r3 = b.call("load", tokens=p3, out=str(tmp_path / "b2.kv"), **cfg)
    assert (r3["hit_tokens"], r3["loaded_tokens"]) == (PAGE, PAGE), r3  # stops at the first miss
    assert same_kv(tmp_path / "a2.kv", tmp_path / "b2.kv", PAGE, tb)

    miss = b.call("load", tokens=prompt(2), out=str(tmp_path / "miss.kv"), **cfg)
    assert (miss["hit_tokens"], miss["loaded_tokens"]) == (0, 0)

    # store KV events: native keys carry SGLang's page event hash, Mooncake's keys carry none
    seen = pool_hit_tokens(conductor, master, stored[0]["event_hashes"])
    assert seen == (4 * PAGE if kind.startswith("native") else 0)


def test_native_segment_killed_mid_load_is_a_miss(engine_pair, tmp_path):
    """The segment holding the pages is stopped, B starts loading, the segment is killed -9:
    B's load ends as a miss (SGLang recomputes), with no error, and B keeps working."""
    a, b = engine_pair
    with MasterServer(admin_port=None) as master:
        addr = f"127.0.0.1:{master.port}"
        segment = spawn_segment(addr, "64MiB")
        try:
            cfg = backend("native", addr, protocol="tcp")  # TCP: a stopped holder stalls reads
            p = prompt(4)
            r = a.call("store", tokens=p, seed=5, out=str(tmp_path / "a.kv"), **cfg)
            assert r["stored_tokens"] == 4 * PAGE
            segment.signal(signal.SIGSTOP)  # from here the load cannot finish before the kill
            b.send("load", tokens=p, out=str(tmp_path / "b.kv"), announce=True, **cfg)
            st = b.read(120)
            assert st == {"stage": "loading", "hit_tokens": 4 * PAGE}, st
            segment.kill()
            r = b.reply(120)  # an error reply would raise here
            assert r["loaded_tokens"] == 0, r
            assert "kvplane HiCache: load failed for 4 of 4 pages" in b.log_tail(), b.log_tail()
            again = b.call("load", tokens=prompt(1), out=str(tmp_path / "c.kv"), **cfg)
            assert again["hit_tokens"] == 0
        finally:
            segment.stop()
