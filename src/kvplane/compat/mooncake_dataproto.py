"""DataProto-style objects on the structured store (``mooncake.structured_object_store``'s
``MooncakeBundleTransfer``): per-stage structured objects behind a light ``MooncakeDataProtoRef``.

A DataProto-like object has ``batch`` (tensors / ndarrays indexed by row), ``non_tensor_batch``
(per-row values) and ``meta_info``; a plain dict with only those keys is an envelope, any other
dict is ``batch`` fields. Each stage is one structured object: ``batch.<name>`` members hold
arrays as they are, ``non_tensor_batch.<name>`` members hold numeric arrays as they are and
object columns encoded row by row (msgpack; ndarrays and tensors inside rows keep dtype and
shape); ``meta_info`` goes in the manifest. The ref maps each field to (stage, member, section);
``export_dataproto_ref`` turns it into a JSON-safe handle of manifest keys.

Also here: the leaf-codec choice (``choose_leaf_codec``) and structure inference
(``infer_structure``) for nested non-tensor values, with ``MISSING`` for absent dict keys.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from kvplane.compat.mooncake_structured import (
    BundleTransferPolicy,
    RemoteBundleRef,
    StructuredMemberSlice,
    StructuredObjectPayload,
    StructuredStore,
    import_ref,
)

MAX_DEPTH = 32
HANDLE_VERSION = 3
SECTIONS = ("batch", "non_tensor_batch")


class _Missing:
    """A dict key absent from one row (unlike a present key whose value is None)."""

    _instance: _Missing | None = None

    def __new__(cls) -> _Missing:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()


def escape_key(key: str) -> str:
    """A dict key as one path component: ``\\``, ``.`` and ``[`` escaped."""
    return key.replace("\\", "\\\\").replace(".", "\\.").replace("[", "\\[")


# -- codecs and structure ---------------------------------------------------------------------------
@dataclass
class FieldSchema:
    """A caller's codec hint for one field (accepted; the row codec here handles every value)."""

    codec: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class LeafDecision:
    codec: str
    accepted: bool
    reason: str = ""


@dataclass
class LeafSpec:
    path: str
    values: list[Any]
    decision: LeafDecision


@dataclass
class NodeSpec:
    path: str
    node_type: str  # "dict" | "list"
    children: list[str] = field(default_factory=list)
    lengths: list[int] | None = None
    row_mask: list[bool] | None = None


def _is_tensor(v: Any) -> bool:
    return type(v).__module__.startswith("torch") and hasattr(v, "dtype")


def _jsonable(v: Any, depth: int = 0) -> bool:
    if depth > MAX_DEPTH:
        return False
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    if isinstance(v, (list, tuple)):
        return all(_jsonable(x, depth + 1) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _jsonable(x, depth + 1) for k, x in v.items())
    return False


def choose_leaf_codec(values: Sequence[Any]) -> LeafDecision:
    """Which codec one column of row values takes (None and MISSING rows are nulls)."""
    present = [v for v in values if v is not None and v is not MISSING]
    if not present:
        return LeafDecision("msgpack_ragged", False, "no values")
    if all(_is_tensor(v) for v in present):
        same = len({v.dtype for v in present}) == 1
        return LeafDecision("ragged_tensor", same, "" if same else "mixed tensor dtypes")
    if all(isinstance(v, (bytes, bytearray)) for v in present):
        return LeafDecision("bytes_ragged", True)
    if all(isinstance(v, str) for v in present):
        return LeafDecision("utf8_ragged", True)
    numbers = (int, float, np.integer, np.floating)
    if all(isinstance(v, numbers) and not isinstance(v, bool) for v in present):
        return LeafDecision("ndarray", True)
    if all(isinstance(v, (list, tuple, np.ndarray)) for v in present) and all(
            np.asarray(v).dtype.kind in "iufb" for v in present):
        return LeafDecision("typed_ragged", True)
    if all(isinstance(v, (dict, list, tuple)) for v in present):
        ok = all(_jsonable(v) for v in present)
        return LeafDecision("msgpack_ragged", ok, "" if ok else "not JSON-like")
    return LeafDecision("msgpack_ragged", False, "unsupported values")


def infer_structure(path: str, values: Sequence[Any], leaves: list[LeafSpec],
                    nodes: list[NodeSpec], depth: int = 0) -> None:
    """Split a column of nested rows into dict/list nodes and typed leaves (appended)."""
    if depth > MAX_DEPTH:
        raise ValueError(f"{path}: nesting deeper than {MAX_DEPTH}")
    present = [v for v in values if v is not None and v is not MISSING]
    if present and all(isinstance(v, dict) for v in present):
        keys = sorted({k for v in present for k in v})
        mask = [isinstance(v, dict) for v in values]
        node = NodeSpec(path, "dict", list(keys), row_mask=mask if not all(mask) else None)
        nodes.append(node)
        for k in keys:
            column = [(v.get(k, MISSING) if isinstance(v, dict) else None) for v in values]
            infer_structure(f"{path}.{escape_key(str(k))}", column, leaves, nodes, depth + 1)
        return
    if present and all(isinstance(v, list) for v in present) and all(
            isinstance(x, dict) or x is None for v in present for x in v) and any(v for v in present):
        lengths = [len(v) if isinstance(v, list) else 0 for v in values]
        nodes.append(NodeSpec(path, "list", [f"{path}[0]"], lengths=lengths))
        flat = [x for v in values if isinstance(v, list) for x in v]
        infer_structure(f"{path}[0]", flat, leaves, nodes, depth + 1)
        return
    leaves.append(LeafSpec(path, list(values), choose_leaf_codec(values)))


# -- row encoding of object columns --------------------------------------------------------------------
def _enc(v: Any, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError("value nests too deep")
    if v is None or isinstance(v, (bool, int, float, str, bytes)):
        return v
    if isinstance(v, (np.integer, np.floating, np.bool_)):
        return v.item()
    if isinstance(v, np.ndarray):
        if v.dtype == object:
            return {"__list__": [_enc(x, depth + 1) for x in v.tolist()]}
        a = np.ascontiguousarray(v)
        return {"__nd__": a.dtype.str, "shape": list(a.shape), "data": a.tobytes()}
    if _is_tensor(v):
        from kvplane.compat import mooncake_tensor_format as fmt

        t = v.detach().cpu().contiguous()
        return {"__t__": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                "data": fmt.tensor_bytes(t).tobytes()}
    if isinstance(v, (list, tuple)):
        return [_enc(x, depth + 1) for x in v]
    if isinstance(v, dict):
        return {"__dict__": [[_enc(k, depth + 1), _enc(x, depth + 1)] for k, x in v.items()]}
    raise TypeError(f"cannot store a {type(v).__name__} in a non-tensor field")


def _dec(v: Any) -> Any:
    if isinstance(v, list):
        return [_dec(x) for x in v]
    if not isinstance(v, dict):
        return v
    if "__nd__" in v:
        return np.frombuffer(v["data"], np.dtype(v["__nd__"])).reshape(v["shape"]).copy()
    if "__t__" in v:
        from kvplane.compat.mooncake_structured import to_torch, torch_np_dtype

        arr = np.frombuffer(v["data"], torch_np_dtype(v["__t__"])).reshape(v["shape"])
        return to_torch(arr, v["__t__"])
    if "__list__" in v:
        return np.asarray([_dec(x) for x in v["__list__"]] + [None], dtype=object)[:-1]
    return {_dec(k): _dec(x) for k, x in v["__dict__"]}


def _encode_rows(values: Any) -> bytes:
    return msgspec.msgpack.encode([_enc(x) for x in list(values)])


def _decode_rows(data: bytes, rows: Any = None) -> np.ndarray:
    items = msgspec.msgpack.decode(data)
    picked = items if rows is None else [items[i] for i in rows]
    out = np.empty(len(picked), dtype=object)
    for i, x in enumerate(picked):
        out[i] = _dec(x)
    return out


# -- the ref ----------------------------------------------------------------------------------------------
@dataclass
class MooncakeDataProtoRef:
    """Where a DataProto's fields live: stage -> structured object, field -> (stage, member,
    section)."""

    stage_refs: dict[str, RemoteBundleRef]
    field_index: dict[str, tuple[str, str, str]]
    batch_size: int
    namespace: str = ""
    partition: str = ""
    meta_info: dict[str, Any] = field(default_factory=dict)
    global_indexes: list[int] | None = None
    _storage_group_id: str | None = None


def export_dataproto_ref(ref: MooncakeDataProtoRef) -> dict[str, Any]:
    """A JSON-safe handle (manifest keys, no manifests)."""
    return {"version": HANDLE_VERSION, "kind": "mooncake_dataproto_ref",
            "stage_refs": {s: {"manifest_key": r.manifest_key} for s, r in ref.stage_refs.items()},
            "field_index": {f: list(v) for f, v in ref.field_index.items()},
            "batch_size": ref.batch_size, "namespace": ref.namespace,
            "partition": ref.partition, "meta_info": _plain(ref.meta_info),
            "global_indexes": ref.global_indexes, "storage_group_id": ref._storage_group_id}


def is_dataproto_ref_handle(value: Any) -> bool:
    return isinstance(value, Mapping) and value.get("kind") == "mooncake_dataproto_ref"


def import_dataproto_ref(handle: Mapping[str, Any]) -> MooncakeDataProtoRef:
    if not is_dataproto_ref_handle(handle):
        raise ValueError("not a DataProto ref handle")
    stages = {s: import_ref(h) for s, h in dict(handle["stage_refs"]).items()}
    index = {}
    for f, loc in dict(handle["field_index"]).items():
        if len(loc) != 3 or loc[0] not in stages or not all(loc):
            raise ValueError(f"field {f!r}: bad location {loc!r}")
        index[f] = (str(loc[0]), str(loc[1]), str(loc[2]))
    group = handle.get("storage_group_id")
    if group is not None and (not isinstance(group, str) or not group):
        raise ValueError("storage_group_id must be a non-empty string or absent")
    gidx = handle.get("global_indexes")
    if gidx is not None and (len(gidx) != int(handle["batch_size"]) or
                             not all(isinstance(i, int) for i in gidx)):
        raise ValueError("global_indexes must be batch_size integers")
    return MooncakeDataProtoRef(stages, index, int(handle["batch_size"]),
                                str(handle.get("namespace", "")), str(handle.get("partition", "")),
                                dict(handle.get("meta_info") or {}), gidx, group)


def _plain(v: Any) -> Any:
    """JSON-safe form of meta_info values (numpy scalars and arrays become Python values)."""
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, (np.generic, np.ndarray)):
        return v.tolist()
    return v


def _sections(data: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    if isinstance(data, Mapping):
        if set(data) <= {"batch", "non_tensor_batch", "meta_info"} and data:
            return (dict(data.get("batch") or {}), dict(data.get("non_tensor_batch") or {}),
                    dict(data.get("meta_info") or {}))
        return dict(data), {}, {}
    if not all(hasattr(data, a) for a in ("batch", "non_tensor_batch", "meta_info")):
        raise TypeError("a DataProto needs batch, non_tensor_batch and meta_info")
    return (dict(data.batch or {}), dict(data.non_tensor_batch or {}),
            dict(data.meta_info or {}))


def _rows_of(rows: Any, n: int) -> list[int] | None:
    if rows is None:
        return None
    if isinstance(rows, slice):
        return list(range(n))[rows]
    if isinstance(rows, StructuredMemberSlice):
        if rows.axis != 0:
            raise ValueError("row selection supports axis=0")
        return list(range(n))[slice(rows.start, rows.end, rows.step)]
    out = [int(r) for r in rows]
    if any(not 0 <= r < n for r in out):
        raise IndexError(f"row index outside [0, {n})")
    return out


class DataProtoMixin:
    """DataProto calls of ``MooncakeBundleTransfer`` (see the module docstring)."""

    def _put_stage(self, batch: dict[str, Any], non_tensor: dict[str, Any], meta: dict[str, Any],
                   stage: str, config: Any, namespace: str, partition: str
                   ) -> tuple[RemoteBundleRef, dict[str, tuple[str, str, str]], int]:
        sizes = {len(v) for v in list(batch.values()) + list(non_tensor.values())}
        if len(sizes) > 1:
            raise ValueError(f"fields have different batch sizes: {sorted(sizes)}")
        n = sizes.pop() if sizes else 0
        overlap = set(batch) & set(non_tensor)
        if overlap:
            raise ValueError(f"fields {sorted(overlap)} are in both batch and non_tensor_batch")
        buffers, index = {}, {}
        for name, value in batch.items():
            buffers[f"batch.{name}"] = value
            index[name] = (stage, f"batch.{name}", "batch")
        codecs = {}
        for name, value in non_tensor.items():
            member = f"non_tensor_batch.{name}"
            arr = value if isinstance(value, np.ndarray) else None
            if arr is not None and arr.dtype != object:
                buffers[member] = arr
            else:
                buffers[member] = _encode_rows(value)
                codecs[member] = "rows"
            index[name] = (stage, member, "non_tensor_batch")
        meta_doc = {"dataproto": {"stage": stage, "namespace": namespace, "partition": partition,
                                  "batch_size": n, "meta_info": _plain(meta), "codecs": codecs}}
        ref = self.put_structured_object(StructuredObjectPayload(buffers, meta_doc),  # type: ignore[attr-defined]  # mixin: the store class has it
                                         config=config)
        return ref, index, n

    def put_dataproto(self, data: Any, namespace: str = "", partition: str = "",
                      stage: str = "default", config: Any = None, **_: Any) -> MooncakeDataProtoRef:
        """Write ``data`` as one stage; its ref."""
        batch, non_tensor, meta = _sections(data)
        ref, index, n = self._put_stage(batch, non_tensor, meta, stage, config, namespace, partition)
        return MooncakeDataProtoRef({stage: ref}, index, n, namespace, partition, _plain(meta))

    def append_dataproto_fields(self, ref: Any, data: Any, stage: str = "default",
                                overwrite: bool = False, config: Any = None) -> MooncakeDataProtoRef:
        """Write more fields as another stage object; existing fields are never rewritten
        (``overwrite`` replaces a whole existing stage)."""
        ref = self._ref(ref)
        batch, non_tensor, meta = _sections(data)
        names = set(batch) | set(non_tensor)
        clash = names & set(ref.field_index)
        if clash and not overwrite:
            raise ValueError(f"fields {sorted(clash)} exist already (overwrite=True replaces)")
        old_stages = {ref.field_index[f][0] for f in clash}
        for s in old_stages:
            if {f for f, loc in ref.field_index.items() if loc[0] == s} - names:
                raise ValueError(f"overwrite must replace every field of stage {s!r}")
        stage_name = stage if stage not in ref.stage_refs or stage in old_stages else \
            f"{stage}#{len(ref.stage_refs)}"
        new_ref, index, n = self._put_stage(batch, non_tensor, meta, stage_name, config,
                                            ref.namespace, ref.partition)
        if n and n != ref.batch_size:
            self.remove_bundle(new_ref)  # type: ignore[attr-defined]  # mixin: the store class has it
            raise ValueError(f"batch size {n} != {ref.batch_size}")
        stages = {s: r for s, r in ref.stage_refs.items() if s not in old_stages or s == stage_name}
        stages[stage_name] = new_ref
        fields = {f: loc for f, loc in ref.field_index.items() if f not in clash}
        fields.update(index)
        for s in old_stages - {stage_name}:
            self.remove_bundle(ref.stage_refs[s])  # type: ignore[attr-defined]  # mixin
        return MooncakeDataProtoRef(stages, fields, ref.batch_size, ref.namespace, ref.partition,
                                    {**ref.meta_info, **_plain(meta)}, ref.global_indexes,
                                    ref._storage_group_id)

    def _ref(self, ref: Any) -> MooncakeDataProtoRef:
        return import_dataproto_ref(ref) if isinstance(ref, Mapping) else ref

    def get_dataproto(self, ref: Any, fields: Sequence[str] | None = None,
                      batch_fields: Sequence[str] | None = None,
                      non_tensor_fields: Sequence[str] | None = None,
                      meta_info_keys: Sequence[str] | None = None, data_cls: Any = None,
                      destinations: Mapping[str, Any] | None = None, rows: Any = None) -> Any:
        """The selected fields (all by default) as a dict, or ``data_cls``."""
        ref = self._ref(ref)
        wanted = self._select(ref, fields, batch_fields, non_tensor_fields)
        picked = _rows_of(rows, ref.batch_size)
        out: dict[str, dict[str, Any]] = {"batch": {}, "non_tensor_batch": {}}
        by_stage: dict[str, list[str]] = {}
        for f in wanted:
            by_stage.setdefault(ref.field_index[f][0], []).append(f)
        for stage, names in by_stage.items():
            members = [ref.field_index[f][1] for f in names]
            spec = self.read_spec(ref.stage_refs[stage]).select_members(members)  # type: ignore[attr-defined]  # mixin: the store class has it
            doc = self._manifest(ref.stage_refs[stage])  # type: ignore[attr-defined]  # mixin
            codecs = doc["metadata"].get("dataproto", {}).get("codecs", {})
            if picked is not None:
                for m in members:
                    if m not in codecs and picked == list(range(picked[0], picked[-1] + 1)):
                        spec = spec.slice_member(m, 0, picked[0], picked[-1] + 1)
            objs = self.materialize(spec).objects  # type: ignore[attr-defined]  # mixin
            for f, m in zip(names, members):
                value = objs[m]
                if m in codecs:
                    value = _decode_rows(value, picked)
                elif picked is not None and m not in spec.slices:
                    value = value[picked]
                value = self._into_destination(f, value, destinations)
                out[ref.field_index[f][2]][f] = value
        meta = dict(ref.meta_info)
        if meta_info_keys is not None:
            meta = {k: meta[k] for k in meta_info_keys if k in meta}
        if data_cls is None:
            return {**out, "meta_info": meta}
        if hasattr(data_cls, "from_dict"):
            try:
                return data_cls.from_dict(out["batch"], out["non_tensor_batch"], meta_info=meta)
            except TypeError:
                pass
        try:
            return data_cls(batch=out["batch"], non_tensor_batch=out["non_tensor_batch"],
                            meta_info=meta)
        except TypeError as exc:
            raise TypeError(f"cannot build {data_cls!r} from the fields: {exc}") from exc

    @staticmethod
    def _select(ref: MooncakeDataProtoRef, fields: Any, batch_fields: Any, non_tensor: Any) -> list[str]:
        if fields is None and batch_fields is None and non_tensor is None:
            return list(ref.field_index)
        wanted = list(fields or [])
        for sel, section in ((batch_fields, "batch"), (non_tensor, "non_tensor_batch")):
            for f in sel or []:
                if f in ref.field_index and ref.field_index[f][2] != section:
                    raise KeyError(f"{f!r} is not a {section} field")
                wanted.append(f)
        unknown = [f for f in wanted if f not in ref.field_index]
        if unknown:
            raise KeyError(f"unknown fields {unknown}")
        return list(dict.fromkeys(wanted))

    @staticmethod
    def _into_destination(name: str, value: Any, destinations: Mapping[str, Any] | None) -> Any:
        if not destinations or name not in destinations:
            return value
        dst = destinations[name]
        src = value if isinstance(value, np.ndarray) else value.numpy()
        if not isinstance(dst, np.ndarray) or dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(f"destination for {name!r} must be {src.dtype} {src.shape}")
        dst[...] = src
        return dst

    def dataproto_manifest_view(self, ref: Any) -> dict[str, dict[str, Any]]:
        """field -> its member's stored spec (encoding, dtype, shape, section, stage)."""
        ref = self._ref(ref)
        view = {}
        for f, (stage, member, section) in ref.field_index.items():
            spec = self._manifest(ref.stage_refs[stage])["buffers"][member]  # type: ignore[attr-defined]  # mixin: the store class has it
            view[f] = {k: v for k, v in spec.items() if k != "chunks"} | {"stage": stage,
                                                                          "section": section}
        return view

    def cleanup_dataproto(self, ref: Any) -> None:
        """Remove every stage object the ref names."""
        ref = self._ref(ref)
        for stage_ref in ref.stage_refs.values():
            self.remove_bundle(stage_ref)  # type: ignore[attr-defined]  # mixin: the store class has it

    # -- unified put/get and single objects ----------------------------------------------------------
    def put(self, data: Any, type: str = "dict", stage: str = "default", config: Any = None,
            **kw: Any) -> MooncakeDataProtoRef:
        """``type="dict"``: array-likes of one length are per-row fields, the rest meta_info;
        ``type="dataproto"``: as put_dataproto."""
        if type == "dataproto":
            return self.put_dataproto(data, stage=stage, config=config, **kw)
        if type != "dict":
            raise ValueError(f"unknown type {type!r}: dict or dataproto")
        lengths = [len(v) for v in data.values() if isinstance(v, (list, tuple, np.ndarray)) or _is_tensor(v)]
        n = max(set(lengths), key=lengths.count) if lengths else 0
        batch, non_tensor, meta = {}, {}, {}
        for k, v in data.items():
            if (_is_tensor(v) or (isinstance(v, np.ndarray) and v.dtype != object)) and len(v) == n:
                batch[k] = v
            elif isinstance(v, (list, tuple, np.ndarray)) and len(v) == n:
                non_tensor[k] = v
            else:
                meta[k] = v
        return self.put_dataproto({"batch": batch, "non_tensor_batch": non_tensor,
                                   "meta_info": meta}, stage=stage, config=config)

    def get(self, ref: Any, type: str = "dict", **kw: Any) -> Any:
        if type == "dataproto":
            return self.get_dataproto(ref, **kw)
        if type != "dict":
            raise ValueError(f"unknown type {type!r}: dict or dataproto")
        got = self.get_dataproto(ref, **kw)
        flat: dict[str, Any] = dict(got["batch"])
        for k, v in got["non_tensor_batch"].items():
            flat[k] = list(v) if isinstance(v, np.ndarray) and v.dtype == object else v
        for k, v in got["meta_info"].items():
            if k in flat:
                raise ValueError(f"{k!r} is both a field and a meta_info key")
            flat[k] = v
        return flat

    def put_object(self, obj: Any, config: Any = None) -> RemoteBundleRef:
        """One object (an ndarray, a tensor, or a dict of them and JSON values)."""
        if isinstance(obj, dict):
            arrays = {k: v for k, v in obj.items() if isinstance(v, np.ndarray) or _is_tensor(v)}
            rest = {k: _enc(v) for k, v in obj.items() if k not in arrays}
            payload = StructuredObjectPayload(arrays, {"object": "dict",
                                                       "rest": msgspec.msgpack.encode(rest).hex()})
        else:
            payload = StructuredObjectPayload({"value": obj}, {"object": "value"})
        return self.put_structured_object(payload, config=config)  # type: ignore[attr-defined]  # mixin

    def get_object(self, ref: RemoteBundleRef) -> Any:
        result = self.materialize(self.read_spec(ref))  # type: ignore[attr-defined]  # mixin
        if result.metadata.get("object") == "value":
            return result.objects["value"]
        out = {k: _dec(v) for k, v in msgspec.msgpack.decode(bytes.fromhex(result.metadata["rest"])).items()}
        out.update(result.objects)
        return out


class MooncakeBundleTransfer(DataProtoMixin, StructuredStore):
    """Mooncake's bundle / structured-object / DataProto helper over a
    ``MooncakeDistributedStore`` (see ``mooncake_structured`` and this module)."""

    def __init__(self, store: Any, key_prefix: str = "", policy: BundleTransferPolicy | None = None,
                 buffer_pool: Any = None, chunk_bytes: int | None = None) -> None:
        from kvplane.compat.mooncake_structured import DEFAULT_BUNDLE_CHUNK_BYTES

        StructuredStore.__init__(self, store, key_prefix, chunk_bytes or DEFAULT_BUNDLE_CHUNK_BYTES,
                                 policy, buffer_pool)

