"""The Mooncake tensor family on kvplane: plain, batch, pub/upsert, zero-copy into/from,
tensor-parallel wrappers, the unified parallel calls, safetensors, and the 304-byte layout."""

from __future__ import annotations

import ctypes

import pytest

from kvplane.compat.mooncake import (
    MooncakeDistributedStore,
    ParallelAxis,
    ReadTarget,
    ReplicateConfig,
    TensorParallelism,
)
from kvplane.compat.mooncake_tensor import deserialize_tensor, serialize_tensor, tensor_metadata_size
from kvplane.store.master.server import MasterServer
from kvplane.testing.needs import need_module

torch = need_module("torch", "pip install torch==2.13.0")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
HEADER = 304


@pytest.fixture(scope="module")
def store():
    with MasterServer(admin_port=None) as m:
        st = MooncakeDistributedStore()
        assert st.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 32 << 20, "tcp", "",
                        f"127.0.0.1:{m.port}") == 0
        yield st
        st.close()


@pytest.fixture
def buf(store):
    raw = (ctypes.c_ubyte * (1 << 20))()
    ptr = ctypes.addressof(raw)
    assert store.register_buffer(ptr, len(raw)) == 0
    yield ptr, len(raw)
    assert store.unregister_buffer(ptr) == 0


def _axis(kind, rank, size, split_dim=None, expert_id=None, stage_id=None):
    a = ParallelAxis()
    a.kind, a.rank, a.size, a.split_dim = kind, rank, size, split_dim
    a.expert_id, a.stage_id = expert_id, stage_id
    return a


def _par(*axes):
    p = TensorParallelism()
    p.axes = list(axes)
    return p


def _target(mode, par=None):
    t = ReadTarget()
    t.mode, t.parallelism = mode, par
    return t


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8, torch.uint8,
                                   torch.int16, torch.int32, torch.int64, torch.bool,
                                   torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                                   torch.float8_e5m2])
def test_every_dtype_round_trips_bit_exact(store, buf, dtype):
    original = (torch.randn(8, 16) * 4).to(dtype)
    key = f"dtype-{dtype}"
    assert store.put_tensor(key, original) == 0
    got = store.get_tensor(key)
    assert got.dtype == dtype and got.shape == original.shape
    assert torch.equal(got.view(torch.uint8), original.view(torch.uint8))
    into = store.get_tensor_into(key, *buf)
    assert torch.equal(into.view(torch.uint8), original.view(torch.uint8))
    assert into.data_ptr() == buf[0] + HEADER  # a view on the caller's buffer


def test_batch_pub_upsert_and_errors(store):
    ts = [torch.arange(10, dtype=torch.int32) + i for i in range(3)]
    assert store.batch_put_tensor(["bt0", "bt1", "bt2"], ts) == [0, 0, 0]
    assert all(torch.equal(a, b) for a, b in zip(store.batch_get_tensor(["bt0", "bt1", "bt2"]), ts))
    cfg = ReplicateConfig()
    cfg.with_hard_pin = True
    assert store.pub_tensor("pt", ts[0], cfg) == 0 and store.batch_pub_tensor(["pt1"], [ts[1]], cfg) == [0]
    assert store.put_tensor("bt0", ts[2]) == 0 and torch.equal(store.get_tensor("bt0"), ts[0])
    assert store.upsert_tensor("bt0", ts[2]) == 0 and torch.equal(store.get_tensor("bt0"), ts[2])
    assert store.upsert_pub_tensor("bt0", ts[1], cfg) == 0
    assert store.batch_upsert_tensor(["bt1"], [ts[0]]) == [0]
    assert store.batch_upsert_pub_tensor(["bt1"], [ts[2]], cfg) == [0]
    assert torch.equal(store.get_tensor("bt1"), ts[2])
    assert store.get_tensor("tensor-missing") is None
    assert store.put("not-a-tensor", b"plain bytes") == 0 and store.get_tensor("not-a-tensor") is None
    assert store.batch_put_tensor(["a"], []) == [-600]
    bad = ReplicateConfig()
    bad.replica_num = 0
    assert store.pub_tensor("bad", ts[0], bad) == -600
    assert MooncakeDistributedStore().put_tensor("x", ts[0]) == -600


def test_tensor_into_and_from_use_the_304_byte_layout(store, buf):
    t = torch.randn(32, 8)
    assert tensor_metadata_size() == HEADER
    assert store.put_tensor("into-src", t) == 0
    got = store.get_tensor_into("into-src", *buf)
    assert torch.equal(got, t)
    total = HEADER + t.numel() * 4
    assert store.put_tensor_from("from-copy", buf[0], total) == 0
    assert torch.equal(store.get_tensor("from-copy"), t)
    assert store.put_tensor_from("from-short", buf[0], total - 1) == -600
    assert store.get_tensor_into("into-src", buf[0], total - 1) is None  # too small a buffer
    assert store.batch_put_tensor_from(["from-b"], [buf[0]], [total]) == [0]
    assert store.upsert_tensor_from("from-b", buf[0], total) == 0
    assert store.batch_get_tensor_into(["from-b", "none"], [buf[0], buf[0] + total + 64],
                                       [total, total]) [1] is None
    header, ptr, size, owner = serialize_tensor(t)
    assert len(header) == HEADER and size == t.numel() * 4 and ptr
    assert torch.equal(deserialize_tensor(header + bytes((ctypes.c_ubyte * size).from_address(ptr))), t)
    dst = torch.zeros(32, 8)
    assert store.get_tensor_into_cuda("into-src", dst) == t.numel() * 4 and torch.equal(dst, t)


def test_tp_wrappers_store_every_shard_under_key_tp_rank(store, buf):
    t = torch.arange(48, dtype=torch.float32).view(6, 8)
    assert store.put_tensor_with_tp("tp", t, tp_rank=1, tp_size=4, split_dim=1) == 0
    for r in range(4):
        assert torch.equal(store.get_tensor(f"tp_tp_{r}"), t.chunk(4, 1)[r])
        assert torch.equal(store.get_tensor_with_tp("tp", r, 4, 1), t.chunk(4, 1)[r])
    assert store.get_tensor_with_tp("tp", 0, 1) is None  # tp_size 1 reads the plain key: none
    shards = store.batch_get_tensor_with_tp(["tp"], tp_rank=2, tp_size=4)
    assert torch.equal(shards[0], t.chunk(4, 1)[2])
    assert torch.equal(store.get_tensor_with_tp_into("tp", *buf, tp_rank=3, tp_size=4), t.chunk(4, 1)[3])
    assert store.put_tensor_with_tp("tp-bad", t, tp_size=16, split_dim=0) == -600  # 6 rows, 16 ranks
    cfg = ReplicateConfig()
    assert store.pub_tensor_with_tp("tp-pub", t, cfg, 0, 2, 0) == 0
    assert store.batch_put_tensor_with_tp(["tp-b"], [t], tp_size=2, split_dim=0) == [0]
    assert torch.equal(store.batch_get_tensor_with_tp(["tp-b"], 1, 2)[0], t.chunk(2, 0)[1])
    assert store.put_tensor("tp-full", t) == 0
    full = store.get_tensor_into("tp-full", *buf)
    assert store.put_tensor_with_tp_from("tp-from", buf[0], buf[1], 0, 2, 1) == 0
    assert torch.equal(store.get_tensor_with_tp("tp-from", 1, 2), t.chunk(2, 1)[1])
    del full


def test_unified_parallelism_shards_full_reads_and_rechunking(store, buf):
    t = torch.arange(4 * 12, dtype=torch.float32).view(4, 12)
    for r in range(4):  # single-axis TP: the input is the shard
        assert store.put_tensor_with_parallelism("u", t.chunk(4, 1)[r], _par(_axis("tp", r, 4, 1))) == 0
    assert torch.equal(store.get_tensor_with_tp("u", 2, 4), t.chunk(4, 1)[2])  # the wrapper's key
    full = store.get_tensor_with_parallelism("u", _target("full", _par(_axis("tp", 0, 4, 1))))
    assert torch.equal(full, t)
    # read with another TP size: rebuilt from the stored shards
    assert torch.equal(store.get_tensor_with_parallelism(
        "u", _target("shard", _par(_axis("tp", 1, 3, 1)))), t.chunk(3, 1)[1])
    assert torch.equal(store.get_tensor_with_parallelism_into(
        "u", *buf, target=_target("full", _par(_axis("tp", 3, 6, 1)))), t)
    # multi-axis: the input is the full tensor; axis order does not matter on read
    for r in range(2):
        assert store.put_tensor_with_parallelism(
            "m", t, _par(_axis("dp", 1, 2), _axis("tp", r, 2, 0))) == 0
    shard = store.get_tensor_with_parallelism(
        "m", _target("shard", _par(_axis("tp", 1, 2, 0), _axis("dp", 1, 2))))
    assert torch.equal(shard, t.chunk(2, 0)[1])
    assert torch.equal(store.get_tensor_with_parallelism(
        "m", _target("full", _par(_axis("dp", 1, 2), _axis("tp", 0, 2, 0)))), t)
    assert store.get_tensor_with_parallelism(  # dp rank 0 was never written
        "m", _target("full", _par(_axis("dp", 0, 2), _axis("tp", 0, 2, 0)))) is None
    # writer partitions: full input, reconstruction without a parallelism
    assert store.put_tensor_with_parallelism("w2", t, writer_partition=(0, 2, 1)) == 0
    assert store.put_tensor_with_parallelism("w2", t, writer_partition=(1, 2, 1)) == 0
    assert torch.equal(store.get_tensor_with_parallelism("w2", _target("full")), t)
    ep = _par(_axis("ep", 0, 2, expert_id=5))
    assert store.put_tensor_with_parallelism("e", t, ep) == 0
    assert torch.equal(store.get_tensor_with_parallelism("e", _target("as_stored", ep)), t)
    assert store.put_tensor_with_parallelism("plain", t) == 0
    assert torch.equal(store.get_tensor_with_parallelism("plain"), t)
    assert store.batch_put_tensor_with_parallelism(["b0", "b1"], [t, t], [None, ep]) == [0, 0]
    assert [x is not None for x in store.batch_get_tensor_with_parallelism(
        ["b0", "b1"], [None, _target("as_stored", ep)])] == [True, True]


@pytest.mark.parametrize("bad", [
    lambda: _par(_axis("dp", 0, 2, split_dim=0)),      # DP has no split dim
    lambda: _par(_axis("ep", 0, 2)),                   # EP needs an expert id
    lambda: _par(_axis("tp", 2, 2, 0)),                # rank outside the size
    lambda: _par(_axis("tp", 0, 2)),                   # TP needs a split dim
    lambda: _par(_axis("tp", 0, 2, 0), _axis("tp", 1, 2, 0)),  # repeated kind
    lambda: _par(_axis("xp", 0, 2)),                   # unknown kind
])
def test_unified_parallelism_rejects_bad_axes(store, bad):
    assert store.put_tensor_with_parallelism("bad-axes", torch.ones(4, 4), bad()) == -600


def test_parallelism_and_writer_partition_together_are_refused(store):
    par = _par(_axis("tp", 0, 2, 0))
    assert store.put_tensor_with_parallelism("both", torch.ones(4, 4), par,
                                             writer_partition=(0, 2, 0)) == -600


def test_safetensors_round_trip(store, tmp_path):
    t = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert store.put_tensor("st-key", t) == 0
    path = str(tmp_path / "t.safetensors")
    assert store.save_tensor_to_safetensor("st-key", path) == 0
    raw = (tmp_path / "t.safetensors").read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    assert b'"dtype":"F32"' in raw[8:8 + header_len] and b'"shape":[2,2]' in raw[8:8 + header_len]
    assert store.remove("st-key", True) == 0
    loaded = store.load_tensor_from_safetensor("st-key", path)
    assert torch.equal(loaded, t) and torch.equal(store.get_tensor("st-key"), t)
    assert store.save_tensor_to_safetensor("st-missing", path) == -704
    other = store.load_tensor_from_safetensor("st-other", path)  # not in the file: its first
    assert torch.equal(other, t) and torch.equal(store.get_tensor("st-other"), t)
