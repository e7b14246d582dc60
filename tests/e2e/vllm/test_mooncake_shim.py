"""vLLM's own MooncakeStoreConnector, unchanged, on kvplane through the ``mooncake`` shim.

The shim directory goes first on the engine's PYTHONPATH; the connector's MOONCAKE_CONFIG_PATH
points at a kvplane master. One engine (embedded mode: its worker contributes the segment) serves
a prompt, resets its local prefix cache, and serves it again from the store.
"""

from __future__ import annotations

import json

import httpx
import pytest
from vllm_harness import BS, Driver, max_diff, prompt, requires_vllm, vllm_env

from kvplane.integrations.mooncake_shim import PATH as SHIM_PATH
from tests.support.auth import headers
from tests.support.store_procs import spawn_master

pytestmark = [pytest.mark.e2e, requires_vllm, pytest.mark.timeout(240)]


def test_vllm_mooncake_store_connector_runs_unchanged_on_kvplane(tmp_path, tiny_model):
    master = spawn_master()
    cfg_path = tmp_path / "mooncake.json"
    cfg_path.write_text(json.dumps({
        "metadata_server": "P2PHANDSHAKE", "master_server_address": master.info["master"],
        "protocol": "tcp", "device_name": "", "global_segment_size": "64MB",
        "local_buffer_size": "16MB"}))
    env = vllm_env(SHIM_PATH, MOONCAKE_CONFIG_PATH=str(cfg_path))
    eng = Driver(tmp_path / "engine.log", {"model_dir": tiny_model, "kv_transfer_config": {
        "kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}}, env)
    try:
        eng.ready(200)
        tokens = prompt(4)
        ref = eng.generate(tokens)
        assert ref["num_cached_tokens"] == 0
        for _ in range(20):  # the connector saves in the background; retry until it landed
            assert eng.call(60, op="reset") is True
            out = eng.generate(tokens)
            if out["num_cached_tokens"]:
                break
        assert out["num_cached_tokens"] == 3 * BS
        assert out["tokens"] == ref["tokens"]
        assert max_diff(out["logprobs"], ref["logprobs"]) == 0.0
        admin = f"http://127.0.0.1:{master.info['admin_port']}"
        keys = httpx.get(f"{admin}/get_all_keys", timeout=5, trust_env=False,
                         headers=headers()).json()
        assert len(keys) >= 3  # the blocks live in kvplane (the venv has no real mooncake)
    finally:
        eng.close()
        master.stop()
