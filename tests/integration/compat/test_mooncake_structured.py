"""mooncake.structured_object_store on kvplane: structured objects (members, chunks, partial
reads), bundles, the DataProto helper with exportable refs, and structure inference."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvplane.compat.mooncake import MooncakeDistributedStore
from kvplane.compat.mooncake_dataproto import (
    MISSING,
    MooncakeBundleTransfer,
    choose_leaf_codec,
    export_dataproto_ref,
    import_dataproto_ref,
    infer_structure,
    is_dataproto_ref_handle,
)
from kvplane.compat.mooncake_structured import StructuredObjectPayload, export_ref, import_ref
from kvplane.store.master.server import MasterServer
from kvplane.testing.needs import requires

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def store():
    with MasterServer(admin_port=None) as m:
        st = MooncakeDistributedStore()
        assert st.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "",
                        f"127.0.0.1:{m.port}") == 0
        yield st
        st.close()


@pytest.fixture
def transfer(store):
    return MooncakeBundleTransfer(store, key_prefix="t", chunk_bytes=40)


def test_structured_object_full_select_slice_and_into(store, transfer):
    tokens = np.arange(24, dtype=np.int32).reshape(6, 4)
    ref = transfer.put_structured_object(StructuredObjectPayload(
        {"tokens": tokens, "raw": b"sample-ids"}, {"step": 7}))
    assert len(ref.manifest["buffers"]["tokens"]["chunks"]) == 3  # 96 bytes in 40-byte chunks
    full = transfer.materialize(transfer.read_spec(ref))
    assert np.array_equal(full.objects["tokens"], tokens) and full.objects["raw"] == b"sample-ids"
    assert full.metadata["step"] == 7 and full.metadata["layout"] == "structured"
    spec = transfer.read_spec(ref).select_members(["tokens"]).slice_member("tokens", 0, 2, 5)
    part = transfer.materialize(spec)
    assert list(part.objects) == ["tokens"] and np.array_equal(part.objects["tokens"], tokens[2:5])
    stepped = transfer.materialize(transfer.read_spec(ref).slice_member("tokens", 0, 0, 6, 2))
    assert np.array_equal(stepped.objects["tokens"], tokens[::2])
    dst = np.empty((3, 4), np.int32)
    assert transfer.materialize_into(spec, {"tokens": dst}).objects["tokens"] is dst
    assert np.array_equal(dst, tokens[2:5])
    with pytest.raises(ValueError):
        transfer.materialize_into(spec, {"tokens": np.empty((2, 4), np.int32)})
    with pytest.raises(ValueError):
        transfer.read_spec(ref).slice_member("tokens", axis=1)
    reader = MooncakeBundleTransfer(store, key_prefix="t")  # another instance, from a handle
    again = reader.materialize(reader.read_spec(import_ref(json.loads(json.dumps(export_ref(ref))))))
    assert np.array_equal(again.objects["tokens"], tokens)
    transfer.remove_bundle(ref)
    assert store.is_exist(ref.manifest_key) == 0
    assert all(store.is_exist(c["key"]) == 0 for c in ref.manifest["buffers"]["tokens"]["chunks"])


def test_torch_members_and_objects(transfer):
    torch = requires("torch")
    t = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    ref = transfer.put_structured_object(StructuredObjectPayload({"t": t}))
    got = transfer.materialize(transfer.read_spec(ref).slice_member("t", 0, 1, 3)).objects["t"]
    assert got.dtype == torch.bfloat16 and torch.equal(got, t[1:3])
    obj = {"a": np.ones(3), "t": t, "step": 3, "tags": ["x"]}
    back = transfer.get_object(transfer.put_object(obj))
    assert torch.equal(back["t"], t) and np.array_equal(back["a"], obj["a"])
    assert back["step"] == 3 and back["tags"] == ["x"]


def test_bundles(store, transfer):
    ref = transfer.put_bundle(b"meta", {"payload": bytes(range(100)), "empty": b""})
    meta, payloads = transfer.get_bundle(ref)
    assert meta == b"meta" and payloads == {"payload": bytes(range(100)), "empty": b""}
    transfer.remove_bundle(ref)
    with pytest.raises(KeyError):
        transfer.get_bundle(import_ref({"manifest_key": ref.manifest_key}))
    with pytest.raises(ValueError):
        transfer.put_bundle(b"m", {"p": b"d"}, chunk_bytes=0)


def test_dataproto_stages_rows_fields_and_handles(store, transfer):
    data = {"batch": {"input_ids": np.arange(12, dtype=np.int64).reshape(4, 3)},
            "non_tensor_batch": {"reward": np.asarray([1.0, 0.0, 0.5, -1.0], np.float32),
                                 "text": np.asarray(["a", "bb", None, "d"], dtype=object),
                                 "ragged": np.asarray([np.arange(2), None, np.arange(3), {"k": 1}],
                                                      dtype=object)},
            "meta_info": {"step": np.int64(7)}}
    ref = transfer.put_dataproto(data, namespace="roll", partition="train", stage="rollout")
    assert ref.batch_size == 4 and set(ref.stage_refs) == {"rollout"}
    got = transfer.get_dataproto(ref)
    assert np.array_equal(got["batch"]["input_ids"], data["batch"]["input_ids"])
    assert list(got["non_tensor_batch"]["text"]) == ["a", "bb", None, "d"]
    assert got["non_tensor_batch"]["ragged"][3] == {"k": 1} and got["meta_info"] == {"step": 7}
    rows = transfer.get_dataproto(ref, fields=["input_ids", "text"], rows=slice(1, 3))
    assert np.array_equal(rows["batch"]["input_ids"], data["batch"]["input_ids"][1:3])
    assert list(rows["non_tensor_batch"]["text"]) == ["bb", None]
    picked = transfer.get_dataproto(ref, batch_fields=["input_ids"], rows=[3, 0])
    assert np.array_equal(picked["batch"]["input_ids"], data["batch"]["input_ids"][[3, 0]])
    with pytest.raises(KeyError):
        transfer.get_dataproto(ref, batch_fields=["reward"])  # a non-tensor field
    ref2 = transfer.append_dataproto_fields(
        ref, {"batch": {"old_log_probs": np.zeros((4, 3), np.float32)}}, stage="logprob")
    with pytest.raises(ValueError):
        transfer.append_dataproto_fields(ref2, {"batch": {"input_ids": np.zeros((4, 3))}})
    with pytest.raises(ValueError):
        transfer.append_dataproto_fields(ref2, {"batch": {"x": np.zeros((5, 3))}}, stage="bad")
    handle = json.loads(json.dumps(export_dataproto_ref(ref2)))
    assert is_dataproto_ref_handle(handle) and not is_dataproto_ref_handle({"a": 1})
    back = import_dataproto_ref(handle)
    sub = MooncakeBundleTransfer(store, key_prefix="t").get_dataproto(back, fields=["old_log_probs"])
    assert sub["batch"]["old_log_probs"].shape == (4, 3)
    view = transfer.dataproto_manifest_view(back)
    assert view["input_ids"]["shape"] == [4, 3] and view["reward"]["section"] == "non_tensor_batch"
    keys = [r.manifest_key for r in ref2.stage_refs.values()]
    transfer.cleanup_dataproto(handle)
    assert [store.is_exist(k) for k in keys] == [0, 0]
    with pytest.raises(ValueError):
        transfer.put_dataproto({"batch": {"a": np.zeros(3)}, "non_tensor_batch": {"b": [1, 2]},
                                "meta_info": {}})


def test_unified_put_get_dict(transfer):
    data = {"input_ids": np.arange(6, dtype=np.int64).reshape(3, 2),
            "tokens": [np.asarray([1, 2]), None, np.asarray([3])], "uid": ["a", "b", "c"],
            "tags": ["science", "math"], "step": 7}
    got = transfer.get(transfer.put(data, type="dict"), type="dict")
    assert np.array_equal(got["input_ids"], data["input_ids"]) and got["tokens"][1] is None
    assert got["uid"] == ["a", "b", "c"] and got["tags"] == ["science", "math"] and got["step"] == 7
    with pytest.raises(ValueError):
        transfer.put(data, type="unknown")


def test_codec_choice_and_structure_inference():
    assert choose_leaf_codec(["a", None, "b"]).codec == "utf8_ragged"
    assert choose_leaf_codec([[1, 2], [3]]).codec == "typed_ragged"
    assert not choose_leaf_codec([object()]).accepted and not choose_leaf_codec([]).accepted
    leaves, nodes = [], []
    infer_structure("r", [{"x": None}, {"y": 2}, None], leaves, nodes)
    assert nodes[0].row_mask == [True, True, False]
    x = next(leaf for leaf in leaves if leaf.path == "r.x")
    assert x.values[0] is None and x.values[1] is MISSING and x.values[2] is None
    deep = 1
    for _ in range(40):
        deep = {"a": deep}
    with pytest.raises(ValueError):
        infer_structure("r", [deep], [], [])
