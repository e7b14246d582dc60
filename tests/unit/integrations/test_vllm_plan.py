"""Pure parts of the vLLM connectors: keys from block hashes, spans, layouts, config parsing."""

from __future__ import annotations

import hashlib
import json
import sys
import threading

import numpy as np
import pytest

from kvplane.common.errors import InvalidArgument, Unavailable
from kvplane.integrations.vllm.config import ConnectorConfig
from kvplane.integrations.vllm.layout import KVLayout, LayerSpan
from kvplane.integrations.vllm.plan import (
    KeySpace,
    LoadJob,
    SaveJob,
    StepPlan,
    blocks_present,
    load_job,
    loadable_blocks,
    matched_tokens,
    save_span,
)
from kvplane.integrations.vllm.saver import BackgroundSaver

pytestmark = pytest.mark.timeout(10)
SPACE = KeySpace("tiny", "float32", 32, 2)


def chain(n: int, seed: bytes = b"s") -> list[bytes]:
    out, parent = [], seed
    for i in range(n):
        parent = hashlib.sha256(parent + bytes([i])).digest()
        out.append(parent)
    return out


def test_keys_follow_the_hash_chain_and_separate_models_dtypes_and_shards():
    h = chain(2)
    keys = SPACE.keys(h)
    assert keys[0] == [f"tiny/float32/bs32/tp0of1/{h[0].hex()}/0", f"tiny/float32/bs32/tp0of1/{h[0].hex()}/1"]
    assert keys == KeySpace("tiny", "float32", 32, 2).keys(h)  # any instance derives the same keys
    others = [KeySpace("other", "float32", 32, 2), KeySpace("tiny", "bfloat16", 32, 2),
              KeySpace("tiny", "float32", 64, 2), KeySpace("tiny", "float32", 32, 2, 1, 2)]
    for o in others:
        assert not set(o.keys(h)[0]) & set(keys[0])


def test_loadable_blocks_never_include_the_block_of_the_last_prompt_token():
    assert loadable_blocks(100, 3, 32) == 3
    assert loadable_blocks(96, 3, 32) == 2  # block-aligned prompt: last block is computed
    assert loadable_blocks(97, 3, 32) == 3
    assert loadable_blocks(10, 0, 32) == 0
    assert loadable_blocks(200, 2, 32) == 2  # no more than the hashes known


def test_matched_tokens_counts_the_leading_run_past_local_hits():
    assert matched_tokens([True, True, False, True], 0, 0, 32) == 64
    assert matched_tokens([True, True], 1, 32, 32) == 64
    assert matched_tokens([False, True], 0, 0, 32) == 0
    assert matched_tokens([], 2, 64, 32) == 0
    assert blocks_present([True, True, True, False, True, True], 2) == [True, False, True]


def test_load_job_maps_granted_tokens_to_local_blocks():
    h = chain(4)
    job = load_job("r", [10, 11, 12, 13], h, 32, 64, SPACE)
    assert job is not None and job.block_ids == [11, 12]
    assert job.keys == SPACE.keys(h[1:3])
    assert load_job("r", [10], h, 0, 0, SPACE) is None
    assert load_job("r", [10], h, 0, 64, SPACE) is None  # not enough allocated blocks


def test_save_span_covers_complete_unsaved_prompt_blocks_only():
    assert save_span(0, 100, 100, 3, 4, 32) == (0, 3)
    assert save_span(0, 40, 100, 3, 4, 32) == (0, 1)  # chunked prefill: only complete blocks
    assert save_span(3, 101, 100, 3, 4, 32) == (3, 3)  # decode steps add nothing
    assert save_span(1, 100, 100, 3, 2, 32) == (1, 2)  # bounded by allocated blocks


class FakeTensor:
    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr

    def is_contiguous(self) -> bool:
        return bool(self.arr.flags.c_contiguous)

    def stride(self, dim: int) -> int:
        return self.arr.strides[dim] // self.arr.itemsize

    def element_size(self) -> int:
        return self.arr.itemsize

    def data_ptr(self) -> int:
        return int(self.arr.ctypes.data)

    @property
    def shape(self):
        return self.arr.shape

    def untyped_storage(self):
        base = self.arr.base if self.arr.base is not None else self.arr
        return type("S", (), {"data_ptr": lambda s: int(base.ctypes.data),
                              "nbytes": lambda s: int(base.nbytes)})()


def test_layout_addresses_are_block_major_and_shared_storage_registers_once():
    whole = np.zeros((2, 8, 2, 32, 128), np.float32)  # two layers in one allocation
    caches = {"l0": FakeTensor(whole[0]), "l1": FakeTensor(whole[1])}
    lay = KVLayout(caches, ["l0", "l1"])
    bb = 2 * 32 * 128 * 4
    assert [s.block_bytes for s in lay.layers] == [bb, bb]
    assert lay.regions == [(int(whole.ctypes.data), whole.nbytes)]
    addrs, sizes = lay.block_addrs([3, 5])
    base0, base1 = int(whole[0].ctypes.data), int(whole[1].ctypes.data)
    assert addrs == [base0 + 3 * bb, base1 + 3 * bb, base0 + 5 * bb, base1 + 5 * bb]
    assert sizes == [bb] * 4
    with pytest.raises(InvalidArgument):
        lay.block_addrs([8])
    with pytest.raises(InvalidArgument):
        KVLayout(caches, ["l0", "missing"])
    assert KVLayout.from_spans([LayerSpan(4096, 64, 2)]).block_addrs([1]) == ([4160], [64])


def test_config_takes_mooncake_names_file_then_extra_config(tmp_path):
    path = tmp_path / "kvplane.json"
    path.write_text(json.dumps({"master_server_address": "tcp://10.0.0.1:50051",
                                "global_segment_size": "512MB", "protocol": "rdma",
                                "device_name": "mlx5_0", "metadata_server": "P2PHANDSHAKE"}))
    cfg = ConnectorConfig.from_sources({"local_buffer_size": 1024, "timeout": "2.5"},
                                       {"KVPLANE_CONFIG_PATH": str(path)})
    assert cfg.master_server_address == "10.0.0.1:50051"
    assert cfg.global_segment_size == 512_000_000 and cfg.local_buffer_size == 1024
    assert cfg.protocol == "rdma" and cfg.timeout == 2.5  # the engine resolves it (fabric)
    over = ConnectorConfig.from_sources({"master_server_address": "127.0.0.1:1"},
                                        {"KVPLANE_CONFIG_PATH": str(path)})
    assert over.master_server_address == "127.0.0.1:1"  # extra config wins over the file
    assert ConnectorConfig.from_sources(None, {}) == ConnectorConfig()


@pytest.mark.parametrize("bad", [{"nope": 1}, {"protocol": "carrier-pigeon"},
                                 {"global_segment_size": "lots"}, {"timeout": 0},
                                 {"save_queue_size": "8"}, {"cache_prefix": "a/b"}])
def test_config_rejects_unknown_or_invalid_settings(bad):
    with pytest.raises(InvalidArgument):
        ConnectorConfig.from_mapping(bad)


def test_config_file_errors_are_reported(tmp_path):
    with pytest.raises(InvalidArgument):
        ConnectorConfig.from_sources({}, {"KVPLANE_CONFIG_PATH": str(tmp_path / "missing.json")})
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(InvalidArgument):
        ConnectorConfig.from_sources({}, {"KVPLANE_CONFIG_PATH": str(tmp_path / "list.json")})


def test_model_prefix_defaults_to_the_model_directory_name():
    assert ConnectorConfig().model_prefix("/tmp/x/tiny-llama/") == "tiny-llama"
    assert ConnectorConfig(cache_prefix="ns").model_prefix("/tmp/x/tiny") == "ns"


def test_background_saver_counts_failures_and_drops_when_full():
    gate, entered = threading.Event(), threading.Event()
    calls = []

    def put(keys, addrs, sizes):
        entered.set()
        gate.wait(5)
        calls.append(keys)
        if keys[0] == "bad":
            raise Unavailable("segment gone")
        return [None] * len(keys)

    s = BackgroundSaver(put, queue_size=1)
    try:
        assert s.submit("r1", ["k1"], [1], [1])
        assert entered.wait(5)  # r1 is running; the queue (size 1) is empty
        assert s.submit("r2", ["bad"], [1], [1])
        assert not s.submit("r3", ["k3"], [1], [1])  # full: dropped, never blocks
        assert s.stats.dropped == 1 and s.pending("r3") == 0
        gate.set()
        assert s.drain(5)
        assert s.pending("r1") == 0 and s.known("r1")
        assert s.stats.failed == 1 and s.stats.saved == 1
        s.forget({"r1"})
        assert not s.known("r1")
    finally:
        gate.set()
        s.close()
    assert "vllm" not in sys.modules  # the pure parts never import vLLM


def test_a_workers_plan_is_in_its_own_ranks_keys():
    sched = KeySpace("m", "float32", 16, 2, tp_rank=0, tp_size=2)
    worker1 = KeySpace("m", "float32", 16, 2, tp_rank=1, tp_size=2)
    hashes = [b"\x01" * 4, b"\x02" * 4]
    plan = StepPlan([LoadJob("r", [3, 4], sched.keys(hashes))],
                    [SaveJob("s", [5], sched.keys(hashes[:1]))], ["p"])
    mine = plan.for_rank(worker1)
    assert mine.loads[0].keys == worker1.keys(hashes)
    assert mine.saves[0].keys == worker1.keys(hashes[:1])
    assert mine.loads[0].block_ids == [3, 4] and mine.preempted == ["p"]
    assert plan.for_rank(sched) is plan  # rank 0 uses the plan as sent
    assert plan.loads[0].keys == sched.keys(hashes)  # the sent plan is not changed


def test_a_key_from_another_space_is_refused():
    w = KeySpace("m", "float32", 16, 2, tp_rank=1, tp_size=2)
    other = KeySpace("other", "float32", 16, 2, tp_rank=0, tp_size=2)
    with pytest.raises(InvalidArgument, match="not under"):
        w.rebase(other.keys([b"\x01"]), w.of_rank(0))


def test_lookup_keys_cover_every_rank():
    sp = KeySpace("m", "float32", 16, 2, tp_rank=0, tp_size=2)
    (row,) = sp.every_rank_keys([b"\xab"])
    assert row == [*sp.block_keys(b"\xab"), *sp.of_rank(1).block_keys(b"\xab")]
    # a block missing on one rank is not present
    assert blocks_present([True, True, True, False], 4) == [False]
