"""kvplane as a backend of vLLM's own OffloadingConnector (``KVPlaneOffloadingSpec``), on real
vLLM CPU 0.32: one engine offloads a prompt's blocks to a kvplane pool, forgets them (prefix-cache
reset), and serves the prompt again from the pool with the same tokens and logprobs; with the
stored objects overwritten by noise, the logprobs move (the KV really comes from the pool).
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from vllm_harness import BS, Driver, max_diff, offload_kv_config, prompt, requires_vllm

from kvplane.store.client.client import StoreClient
from kvplane.store.config import StoreConfig
from tests.support.auth import headers
from tests.support.services import wait_until
from tests.support.store_procs import spawn_master, spawn_segment

pytestmark = [pytest.mark.e2e, requires_vllm, pytest.mark.timeout(240)]
LAYERS = 2
FULL_BLOCKS = 3  # 100-token prompts: blocks 0..2 are offloadable, the 4-token tail is computed


def test_offloaded_blocks_come_back_from_the_pool_bit_exact(tmp_path, tiny_model):
    with spawn_master() as master, spawn_segment(master.info["master"], "64MiB"):
        admin = f"http://127.0.0.1:{master.info['admin_port']}"

        def stored() -> list[str]:
            keys = httpx.get(f"{admin}/get_all_keys", timeout=5, trust_env=False,
                             headers=headers()).json()
            return [k for k in keys if "/off/" in k]

        eng = Driver(tmp_path / "engine.log", {"model_dir": tiny_model,
                                               "kv_transfer_config": offload_kv_config(
                                                   master.info["master"])})
        try:
            eng.ready(200)
            tokens = prompt(11)
            ref = eng.generate(tokens)
            assert ref["num_cached_tokens"] == 0
            wait_until(lambda: len(stored()) >= FULL_BLOCKS * LAYERS, 30, "offloaded blocks")
            assert len(stored()) == FULL_BLOCKS * LAYERS  # one object per chunk and layer
            assert eng.call(30, op="reset") is True  # vLLM's own cache forgets the prompt
            out = eng.generate(tokens)
            assert out["num_cached_tokens"] == FULL_BLOCKS * BS  # all three blocks from the pool
            assert out["tokens"] == ref["tokens"]
            assert max_diff(out["logprobs"], ref["logprobs"]) == 0.0
            assert "kvplane offload worker" in eng.log_text()
            rng = np.random.default_rng(7)
            with StoreClient(StoreConfig(master=master.info["master"], protocol="tcp",
                                         local_buffer_size=1 << 20, timeout=5)) as c:
                for key in stored():
                    c.upsert(key, rng.standard_normal(c.get_size(key) // 4)
                             .astype(np.float32).tobytes())
            assert eng.call(30, op="reset") is True
            bad = eng.generate(tokens)
            assert bad["num_cached_tokens"] == FULL_BLOCKS * BS
            assert max_diff(bad["logprobs"], ref["logprobs"]) > 1e-3
        finally:
            eng.close()
