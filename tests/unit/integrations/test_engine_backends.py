"""The pure parts of the SGLang and LMCache backends: keys, their KV-event hashes (as the store
master reads them), settings, and the packages' lazy surfaces."""

from __future__ import annotations

import hashlib
import sys

import pytest

import kvplane.integrations.lmcache as lmc
import kvplane.integrations.sglang as sgl
from kvplane.common.errors import InvalidArgument
from kvplane.integrations.lmcache.keys import event_hash, key_string, leading, store_key
from kvplane.integrations.lmcache.settings import claims, plugin_settings
from kvplane.integrations.sglang.keys import PageKeys, leading_pages, shard_name
from kvplane.integrations.sglang.keys import event_hash as page_event_hash
from kvplane.integrations.store_backend import StoreBackendConfig
from kvplane.store.master.pool_events import key_hash

pytestmark = pytest.mark.timeout(10)
U64 = (1 << 64) - 1


def sha(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def test_packages_resolve_lazily_without_the_engines():
    assert sgl.__all__ == ["KVPlaneHiCacheStorage"]
    assert sorted(lmc.__all__) == ["KVPlaneConnector", "KVPlaneConnectorAdapter"]
    assert "sglang" not in sys.modules and "lmcache" not in sys.modules
    with pytest.raises(AttributeError):
        sgl.Nope  # noqa: B018
    with pytest.raises(AttributeError):
        lmc.Nope  # noqa: B018


def test_the_harness_names_the_shim_without_importing_it():
    import kvplane.integrations.mooncake_shim as shim
    from tests.support.engines_harness import SHIM_PATH

    assert str(SHIM_PATH) == shim.PATH


def test_sglang_page_keys_carry_sglangs_event_hash_for_the_master():
    keys = PageKeys("org/model", "page_first", "bfloat16", 64, "tp0of2", 2)
    h = sha(1)
    k, v = keys.page(h)
    assert k.startswith("sglang/org-model/page_first/bfloat16/ps64/tp0of2/" + h + "/k/")
    assert v.startswith(keys.namespace + "/" + h + "/v/")
    # SGLang's own events publish hash_str_to_int64(h): the first 16 hex digits as int64
    want = int(h[:16], 16)
    assert page_event_hash(h) == want and key_hash(k) == want == key_hash(v)
    assert keys.pages([sha(1), sha(2)])[2:] == keys.page(sha(2))


def test_sglang_keys_separate_whatever_changes_the_bytes():
    h = sha(3)
    base = PageKeys("m", "page_first", "float16", 64, "tp0of1", 2)
    others = [PageKeys("m", "page_first_direct", "float16", 64, "tp0of1", 2),
              PageKeys("m", "page_first", "bfloat16", 64, "tp0of1", 2),
              PageKeys("m", "page_first", "float16", 32, "tp0of1", 2),
              PageKeys("m", "page_first", "float16", 64, "tp1of2", 2),
              PageKeys("m2", "page_first", "float16", 64, "tp0of1", 2)]
    assert all(set(base.page(h)).isdisjoint(o.page(h)) for o in others)
    mla = PageKeys("m", "page_first", "float16", 64, shard_name(3, 4, 0, 1, True), 1)
    assert len(mla.page(h)) == 1 and "/mla/" in mla.page(h)[0] and "/kv/" in mla.page(h)[0]


def test_sglang_non_hex_page_hash_is_stored_but_not_published():
    keys = PageKeys("m", "page_first", "float16", 64, "tp0of1", 2)
    assert page_event_hash("not-a-hash") is None
    assert [key_hash(k) for k in keys.page("not-a-hash")] == [None, None]


def test_shards_and_leading_pages():
    assert shard_name(1, 4, 0, 1, False) == "tp1of4"
    assert shard_name(1, 4, 2, 3, False) == "tp1of4-pp2of3"
    assert shard_name(1, 4, 0, 2, True) == "mla-pp0of2"
    assert leading_pages([True, True, True, False, True, True], 2) == 1  # page 1 lacks V
    assert leading_pages([True] * 6, 2) == 3 and leading_pages([], 2) == 0
    assert leading_pages([False, True, True, True], 1) == 0


@pytest.mark.parametrize("chunk_hash", [0x1234, -0x428B629CAB8BBD84, (1 << 64) - 1])
def test_lmcache_keys_keep_the_cache_engine_key_and_publish_the_chunk_hash(chunk_hash):
    ks = f"org/model@2@1@{chunk_hash:x}@bfloat16@user%alice"
    key = store_key(ks, chunk_hash)
    assert key_string(key) == ks  # CacheEngineKey.to_string() intact, tags and '/' included
    assert key_hash(key) == chunk_hash & U64 == event_hash(chunk_hash)
    digest = hashlib.sha256(b"x").digest()
    assert key_hash(store_key(ks, digest)) == int.from_bytes(digest[-8:], "big")
    with pytest.raises(ValueError):
        key_string("tiny@1@0@ab@float")
    assert leading([True, False, True]) == 1 and leading([True, True]) == 2


def test_lmcache_plugin_settings_and_urls():
    extra = {"remote_storage_plugin.kvplane.module_path": "x",
             "remote_storage_plugin.kvplane.class_name": "y",
             "remote_storage_plugin.kvplane.url": "kvplane://10.0.0.1:7000",
             "remote_storage_plugin.kvplane.protocol": "rdma",
             "remote_storage_plugin.kvplane.timeout": "2.5", "chunk_meta": True,
             "remote_storage_plugin.other.protocol": "nonsense"}
    cfg = plugin_settings(extra, "kvplane", "plugin://kvplane")
    assert (cfg.master_server_address, cfg.protocol, cfg.timeout) == ("10.0.0.1:7000", "rdma", 2.5)
    assert plugin_settings(extra, "kvplane", "kvplane://h:1/").master_server_address == "h:1"
    with pytest.raises(InvalidArgument):
        plugin_settings({"remote_storage_plugin.kvplane.url": "redis://h:1"}, "kvplane", "plugin://kvplane")
    with pytest.raises(InvalidArgument):
        plugin_settings({"remote_storage_plugin.kvplane.tyop": 1}, "kvplane", "")
    assert claims("kvplane://h:1") and claims("plugin://kvplane") and claims("plugin://kvplane.b")
    assert not claims("plugin://kvplanex") and not claims("mooncakestore://h:1")


def test_store_backend_config_accepts_mooncake_spellings():
    cfg = StoreBackendConfig.from_mapping(
        {"master_server_addr": "tcp://h:5", "mooncake_protocol": "tcp", "device_name": "mlx5",
         "global_segment_size": "4gb", "local_buffer_size": 0, "mooncake_prefer_local_alloc": 1,
         "interface_v1": True}, ignore=("interface_v1",))
    assert (cfg.master_server_address, cfg.protocol) == ("h:5", "tcp")
    assert (cfg.global_segment_size, cfg.local_buffer_size) == (4 * 10**9, 0)
    with pytest.raises(InvalidArgument, match="unknown kvplane backend setting 'interface_v1'"):
        StoreBackendConfig.from_mapping({"interface_v1": True})
    with pytest.raises(InvalidArgument):
        StoreBackendConfig.from_mapping({"protocol": "carrier-pigeon"})
    store = StoreBackendConfig(token="t", timeout=3).store_config()
    assert (store.token, store.timeout, store.master) == ("t", 3.0, "127.0.0.1:50051")
