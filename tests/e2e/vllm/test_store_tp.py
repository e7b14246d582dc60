"""Tensor parallel 2 on real vLLM CPU 0.32 with KVPlaneStoreConnector: each TP worker saves and
loads its own shard of the heads (keys ``.../tp{rank}of2/...``), so a prefix served from the
store gives exactly the tokens and logprobs of the run that computed it.

Before the fix the scheduler's rank-0 keys went to both workers: rank 1 saved into and loaded
rank 0's shard, and the cached run produced other tokens."""

from __future__ import annotations

import httpx
import pytest
from vllm_harness import BS, Driver, max_diff, prompt, requires_vllm, store_kv_config

from tests.support.auth import headers
from tests.support.services import wait_until
from tests.support.store_procs import spawn_master, spawn_segment

pytestmark = [pytest.mark.e2e, requires_vllm, pytest.mark.timeout(400)]
LAYERS, FULL_BLOCKS, TP = 2, 3, 2


def test_tp2_prefix_from_the_store_matches_the_computed_run(tmp_path, tiny_model):
    with spawn_master() as master, spawn_segment(master.info["master"], "64MiB"):
        admin = f"http://127.0.0.1:{master.info['admin_port']}"

        def keys() -> list[str]:
            return list(httpx.get(f"{admin}/get_all_keys", timeout=5, trust_env=False,
                                  headers=headers()).json())

        cfg = {"model_dir": tiny_model, "tensor_parallel_size": TP,
               "kv_transfer_config": store_kv_config(master.info["master"])}
        eng = Driver(tmp_path / "tp2.log", cfg)
        try:
            eng.expect("READY", 300)
            tokens = prompt(7)
            ref = eng.generate(tokens)
            assert ref["num_cached_tokens"] == 0
            want = FULL_BLOCKS * LAYERS * TP
            wait_until(lambda: len(keys()) >= want, 30, "both ranks' saves")
            stored = keys()
            for r in range(TP):
                assert sum(f"/tp{r}of{TP}/" in k for k in stored) == FULL_BLOCKS * LAYERS, stored
            assert eng.call(30, op="reset") is True
            out = eng.generate(tokens)  # the local cache is empty: the prefix comes from kvplane
            assert out["num_cached_tokens"] == FULL_BLOCKS * BS
            assert out["tokens"] == ref["tokens"]
            assert max_diff(out["logprobs"], ref["logprobs"]) == 0.0
        finally:
            eng.close()
