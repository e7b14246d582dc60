"""Prefill -> decode with tensor parallel 2 on both sides, real vLLM CPU 0.32 servers.

Each TP worker holds its own shard (its heads) of the same blocks. The prefill params list
every rank (``remote_ranks``) and decode rank r pulls from prefill rank r. Before this, the
scheduler kept rank 0's handshake only, so decode rank 1 filled its shard with prefill rank 0's
heads; this test compares the PD answer with the prefill instance answering alone.
"""

from __future__ import annotations

import signal
import sys

import pytest
from test_pd import complete, pd_kv_config
from vllm_harness import max_diff, prompt, requires_vllm

from kvplane.common.procs import Proc
from tests.support.services import wait_until
from tests.support.vllm_harness import OpenAIServer

pytestmark = [pytest.mark.e2e, requires_vllm, pytest.mark.timeout(900)]
TP = 2


def tp_server(model: str, role: str, log_path) -> OpenAIServer:
    # four TP workers on 2 cores: a CI run saw a peer's handshake take over 10 s (the pull then
    # fell back to recompute, right answer, but not the path under test)
    import json

    return OpenAIServer(model, log_path, extra=[
        "--disable-hybrid-kv-cache-manager", "--kv-transfer-config",
        json.dumps(pd_kv_config(role, timeout=60)), "--tensor-parallel-size", str(TP),
        "--distributed-executor-backend", "mp"],
        # the peer's listener thread shares its process with a spinning vLLM worker: a HELLO
        # answer took over 5 s (the default connect timeout) in a full-suite run
        env={"KVPLANE_CONNECT_TIMEOUT": "60"})


def test_tp2_decode_ranks_pull_their_own_prefill_shards(tmp_path, tiny_model):
    model = "tiny"
    p = tp_server(tiny_model, "kv_producer", tmp_path / "prefill.log")
    d = tp_server(tiny_model, "kv_consumer", tmp_path / "decode.log")
    proxy = None
    try:
        wait_until(p.ready, 600, "prefill server (TP=2)")
        wait_until(d.ready, 600, "decode server (TP=2)")
        # four TP workers spin on 2 cores: slow /health answers must not eject a live instance
        proxy = Proc([sys.executable, "-m", "kvplane.cli.main", "router", "--prefill", p.url,
                      "--decode", d.url, "--port", "0", "--health-timeout", "10",
                      "--eject-after", "30"], ready_timeout=30, stop_signal=signal.SIGTERM)
        tokens = prompt(5, 97)  # 4 blocks move, per rank
        ref = complete(p.url, model, tokens)
        ref_same_path = complete(p.url, model, tokens)  # 96 cached + 1 computed, as decode does
        out = complete(proxy.info["proxy"], model, tokens)
        assert out["tokens"] == ref["tokens"] == ref_same_path["tokens"]
        assert max_diff(out["logprobs"], ref_same_path["logprobs"]) < 1e-5
        dlog = d.log_path.read_text()
        assert dlog.count("kvplane PD: pulled 4 blocks") >= TP, dlog[-3000:]
        assert "FAILED" not in dlog
        # both prefill ranks were released: a second request still gets served
        again = complete(proxy.info["proxy"], model, prompt(6))
        assert len(again["tokens"]) == 8
    finally:
        if proxy is not None:
            proxy.stop()
        p.close()
        d.close()
