"""The native SGLang / LMCache backends reach a token-protected master: the token comes from
their own setting, else from wherever a StoreClient finds it (``KVPLANE_TOKEN``), and a wrong one
is refused. (Pure kvplane: the backends' store settings, no engine needed.)"""

from __future__ import annotations

import pytest

from kvplane.common.errors import Unauthorized
from kvplane.integrations.lmcache.settings import plugin_settings
from kvplane.integrations.store_backend import StoreBackendConfig
from kvplane.store import MasterServer

TOKEN = "engines-s3cret"
SEGMENT = str(16 << 20)  # the client holds the pool: its data listener checks the token too


@pytest.fixture
def master():
    with MasterServer(admin_port=None, token=TOKEN) as m:
        yield f"127.0.0.1:{m.port}"


def roundtrip(cfg: StoreBackendConfig, key: str) -> bytes:
    with cfg.open_client() as client:
        client.put(key, b"kv")
        return client.get(key)


def test_token_setting_reaches_the_master(master):
    sglang = StoreBackendConfig.from_mapping(
        {"master_server_address": master, "protocol": "tcp", "token": TOKEN,
         "global_segment_size": SEGMENT, "backend_name": "kvplane"}, ignore=("backend_name",))
    assert roundtrip(sglang, "sglang-k") == b"kv"
    lmcache = plugin_settings({"remote_storage_plugin.kvplane.token": TOKEN,
                               "remote_storage_plugin.kvplane.protocol": "tcp",
                               "remote_storage_plugin.kvplane.global_segment_size": SEGMENT},
                              "kvplane", f"kvplane://{master}")
    assert roundtrip(lmcache, "lmcache-k") == b"kv"


def test_token_found_like_a_store_client(master, monkeypatch):
    monkeypatch.setenv("KVPLANE_TOKEN", TOKEN)
    cfg = StoreBackendConfig.from_mapping({"master_server_address": master, "protocol": "tcp",
                                          "global_segment_size": SEGMENT})
    assert cfg.store_config().token == TOKEN
    assert roundtrip(cfg, "env-k") == b"kv"


def test_wrong_token_is_refused(master):
    cfg = StoreBackendConfig(master_server_address=master, protocol="tcp", token="wrong", timeout=3)
    with pytest.raises(Unauthorized):
        cfg.open_client()
