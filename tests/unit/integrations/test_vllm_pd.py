"""PD pure parts (pull planning). The proxy choreography is tested with the router
(tests/unit/gateway/test_gateway_mock.py), which `kvplane pd-proxy` is an alias of."""

from __future__ import annotations

import pytest

from kvplane.integrations.vllm.layout import KVLayout, LayerSpan
from kvplane.integrations.vllm.pd_plan import params_ok, pull_job, read_requests
from kvplane.transfer import OpCode

pytestmark = pytest.mark.timeout(20)
LAYERS = [[1 << 20, 4096, 64], [2 << 20, 4096, 64]]
PARAMS = {"remote_segment": "127.0.0.1:9", "remote_notify": "tcp://127.0.0.1:8",
          "remote_layers": LAYERS, "remote_block_ids": [40, 41, 42, 43], "remote_request_id": "p1"}


def test_pull_job_maps_prompt_blocks_past_the_local_hit():
    job = pull_job("d1", PARAMS, [7, 8, 9, 10, 11], 32, 65, 32)  # 97-token prompt, 1 block local
    assert job.local_blocks == [8, 9, 10] and job.remote_blocks == [41, 42, 43]
    assert job.remote_req_id == "p1" and job.segment == "127.0.0.1:9"
    full = pull_job("d1", PARAMS, [7, 8, 9, 10], 0, 97, 32)
    assert full.local_blocks == [7, 8, 9, 10] and full.remote_blocks == [40, 41, 42, 43]


def test_pull_job_without_a_source_leaves_blocks_for_recompute():
    release = pull_job("d1", PARAMS, [7, 8], 64, 0, 32)  # local hit: nothing to read
    assert release.local_blocks == [] and release.remote_blocks == []
    short = pull_job("d1", {**PARAMS, "remote_block_ids": [40]}, [7, 8, 9], 0, 90, 32)
    assert short.local_blocks == [7, 8, 9] and short.remote_blocks == []  # -> reported failed
    bad = pull_job("d1", {**PARAMS, "remote_layers": [["x"]]}, [7, 8, 9], 0, 90, 32)
    assert bad.remote_blocks == []
    assert not params_ok({"remote_segment": "a"}) and params_ok(PARAMS)


def test_read_requests_pair_remote_and_local_addresses_per_layer():
    job = pull_job("d1", PARAMS, [0, 1, 2, 3], 0, 40, 32)
    local = KVLayout.from_spans([LayerSpan(8 << 20, 4096, 16), LayerSpan(9 << 20, 4096, 16)])
    reqs = read_requests(job, local, handle=5)
    assert [(r.source, r.target_offset) for r in reqs] == [
        ((8 << 20), (1 << 20) + 40 * 4096), ((9 << 20), (2 << 20) + 40 * 4096),
        ((8 << 20) + 4096, (1 << 20) + 41 * 4096), ((9 << 20) + 4096, (2 << 20) + 41 * 4096)]
    assert all(r.op == OpCode.READ and r.target == 5 and r.length == 4096 for r in reqs)
    other = KVLayout.from_spans([LayerSpan(8 << 20, 2048, 16), LayerSpan(9 << 20, 2048, 16)])
    with pytest.raises(Exception, match="layouts differ"):
        read_requests(job, other, handle=5)


RANKS = [{"segment": f"127.0.0.1:{90 + r}", "notify": f"tcp://127.0.0.1:{80 + r}",
          "layers": [[(r + 1) << 24, 4096, 64], [(r + 1) << 25, 4096, 64]]} for r in range(2)]


def test_each_decode_rank_reads_its_own_prefill_rank():
    job = pull_job("d1", {**PARAMS, "remote_ranks": RANKS}, [7, 8, 9, 10], 0, 97, 32)
    r0, r1 = job.on_rank(0, 2), job.on_rank(1, 2)
    assert (r0.segment, r0.notify, r0.layers) == ("127.0.0.1:90", "tcp://127.0.0.1:80",
                                                  RANKS[0]["layers"])
    assert (r1.segment, r1.notify, r1.layers) == ("127.0.0.1:91", "tcp://127.0.0.1:81",
                                                  RANKS[1]["layers"])
    assert r0.remote_blocks == r1.remote_blocks == [40, 41, 42, 43]
    assert r0.notifies() == ["tcp://127.0.0.1:80"] and r1.notifies() == ["tcp://127.0.0.1:81"]
    local = KVLayout.from_spans([LayerSpan(8 << 20, 4096, 16), LayerSpan(9 << 20, 4096, 16)])
    src = {r.target_offset for r in read_requests(r1, local, handle=1)}
    assert min(src) == (2 << 24) + 40 * 4096  # rank 1's shard, not rank 0's


def test_a_tp_size_mismatch_recomputes_and_still_releases_every_prefill_rank():
    four = [{**RANKS[0], "notify": f"tcp://127.0.0.1:{80 + r}"} for r in range(4)]
    job = pull_job("d1", {**PARAMS, "remote_ranks": four}, [7, 8, 9, 10], 0, 97, 32)
    runs = [job.on_rank(r, 2) for r in range(2)]
    assert all(j.local_blocks == [7, 8, 9, 10] and j.remote_blocks == [] for j in runs)
    released = [a for j in runs for a in j.notifies()]
    assert sorted(released) == sorted(r["notify"] for r in four)  # each exactly once
    # a TP=1 prefill side (no remote_ranks) seen from a TP=2 decode: recompute, rank 0 releases
    single = pull_job("d1", PARAMS, [7, 8, 9, 10], 0, 97, 32)
    assert single.on_rank(0, 2).remote_blocks == [] and single.on_rank(1, 2).notifies() == []
    assert single.on_rank(0, 2).notifies() == ["tcp://127.0.0.1:8"]
    assert single.on_rank(0, 1).remote_blocks == [40, 41, 42, 43]


def test_malformed_remote_ranks_are_recomputed():
    bad = pull_job("d1", {**PARAMS, "remote_ranks": [{"segment": "x"}]}, [7, 8], 0, 40, 32)
    assert bad.remote_blocks == []
    worse = pull_job("d1", {**PARAMS, "remote_ranks": "nope"}, [7, 8], 0, 40, 32)
    assert worse.remote_blocks == []
