"""Structured objects and bundles on a Mooncake-compatible store (the core of
``mooncake.structured_object_store``).

One *structured object* = named members (ndarrays, torch tensors, bytes) plus JSON metadata.
Each member is cut into chunks of at most ``chunk_bytes`` stored under their own keys; a
manifest (JSON) under ``"{prefix}/{id}/manifest"`` lists the members (encoding, dtype, shape,
chunk keys and offsets). Reads start from a ``StructuredObjectReadSpec``: ``select_members``
narrows the members, ``slice_member(name, axis=0, start, end, step)`` reads only the rows it
needs (only the chunks that hold them), ``materialize`` returns new objects and
``materialize_into`` fills arrays the caller owns. A *bundle* is the same without member types:
a manifest of raw bytes plus named byte payloads (``put_bundle`` / ``remove_bundle``).

kvplane's own design (layout and keys are not Mooncake's); the calls and their results follow
Mooncake's documentation. Writes go through ``store.put`` (or ``batch_put_from`` from a
BufferPool lease with ``copy_mode="auto"``); a failed write removes what it wrote and raises
RuntimeError. Imports numpy; torch only for tensor members.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

DEFAULT_BUNDLE_CHUNK_BYTES = 64 << 20
AUTO_PARALLEL_MIN_BYTES = 4 << 20
FIELDS_KEY = "__mooncake_structured_fields__"
_NAME = re.compile(r"^[A-Za-z0-9_.\[\]\\:/-]{1,256}$")


@dataclass(frozen=True)
class BundleTransferPolicy:
    """How payloads are written: "auto" (BufferPool + batch_put_from when the store has them,
    else ``put``), "copy" (always ``put``), "zero_copy" (tensor-object buffers only)."""

    copy_mode: str = "auto"

    def __post_init__(self) -> None:
        if self.copy_mode not in ("auto", "copy", "zero_copy"):
            raise ValueError(f"copy_mode must be auto, copy or zero_copy, got {self.copy_mode!r}")


@dataclass
class StructuredObjectPayload:
    """A structured object to write: ``buffers`` name -> ndarray / torch tensor / bytes."""

    buffers: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StructuredMemberSlice:
    """Rows ``[start:end:step]`` along ``axis`` (0 only) of one member."""

    axis: int = 0
    start: int | None = None
    end: int | None = None
    step: int | None = None


@dataclass
class RemoteBundleRef:
    """Where a bundle or structured object lives; ``manifest`` is loaded on first read when an
    imported ref carries only the key."""

    manifest_key: str
    manifest: dict[str, Any] = field(default_factory=dict)


@dataclass
class StructuredObjectReadSpec:
    """What to read of one structured object (immutable steps return new specs)."""

    ref: RemoteBundleRef
    members: tuple[str, ...] | None = None
    slices: dict[str, StructuredMemberSlice] = field(default_factory=dict)

    def select_members(self, names: Sequence[str]) -> StructuredObjectReadSpec:
        return replace(self, members=tuple(names))

    def slice_member(self, name: str, axis: int = 0, start: int | None = None,
                     end: int | None = None, step: int | None = None) -> StructuredObjectReadSpec:
        if axis != 0:
            raise ValueError("slice_member supports axis=0")
        return replace(self, slices={**self.slices, name: StructuredMemberSlice(axis, start, end, step)})


@dataclass
class MaterializeResult:
    objects: dict[str, Any]
    metadata: dict[str, Any]


def export_ref(ref: RemoteBundleRef) -> dict[str, str]:
    """A JSON-safe handle of a ref (the manifest key only)."""
    return {"manifest_key": ref.manifest_key}


def import_ref(handle: Mapping[str, Any]) -> RemoteBundleRef:
    key = handle.get("manifest_key") if isinstance(handle, Mapping) else None
    if not isinstance(key, str) or not key:
        raise ValueError("a bundle handle needs a non-empty manifest_key")
    return RemoteBundleRef(key)


def _member_spec(value: Any) -> tuple[dict[str, Any], memoryview]:
    """(manifest entry without chunks, bytes) of one member value."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"encoding": "bytes"}, memoryview(bytes(value))
    if type(value).__module__.startswith("torch"):
        from kvplane.compat import mooncake_tensor_format as fmt

        data = fmt.tensor_bytes(value)
        return ({"encoding": "tensor", "dtype": str(value.dtype).removeprefix("torch."),
                 "shape": list(value.shape)}, data)
    if isinstance(value, np.ndarray) and value.dtype != object:
        arr = np.ascontiguousarray(value)
        return ({"encoding": "ndarray", "dtype": arr.dtype.str, "shape": list(arr.shape)},
                arr.reshape(-1).view(np.uint8).data if arr.size else memoryview(b""))
    raise TypeError(f"structured members are ndarrays, torch tensors or bytes, not "
                    f"{type(value).__name__}")


class StructuredStore:
    """Bundles and structured objects on one Mooncake-compatible store."""

    def __init__(self, store: Any, key_prefix: str = "", chunk_bytes: int = DEFAULT_BUNDLE_CHUNK_BYTES,
                 policy: BundleTransferPolicy | None = None, buffer_pool: Any = None) -> None:
        if key_prefix and not _NAME.match(key_prefix):
            raise ValueError(f"bad key prefix {key_prefix!r}")
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be > 0")
        self.store, self.key_prefix = store, key_prefix.rstrip("/")
        self.chunk_bytes, self.policy = chunk_bytes, policy or BundleTransferPolicy()
        self.buffer_pool = buffer_pool

    # -- writes -------------------------------------------------------------------------------------
    def _new_base(self) -> str:
        base = uuid.uuid4().hex
        return f"{self.key_prefix}/{base}" if self.key_prefix else base

    def _write(self, items: list[tuple[str, memoryview]], config: Any, policy: BundleTransferPolicy) -> None:
        written: list[str] = []
        try:
            for key, data in items:
                rc = self.store.put(key, data, config) if config is not None else self.store.put(key, data)
                if rc != 0:
                    raise RuntimeError(f"put of {key!r} failed with code {rc}")
                written.append(key)
        except BaseException:
            self._remove_keys(written)
            raise

    def _remove_keys(self, keys: Sequence[str]) -> None:
        if not keys:
            return
        if hasattr(self.store, "batch_remove"):
            self.store.batch_remove(list(keys), True)
        else:
            for k in keys:
                self.store.remove(k, True)

    def _chunks(self, base: str, name: str, data: memoryview, chunk_bytes: int) -> list[dict[str, Any]]:
        out = []
        for i, off in enumerate(range(0, len(data), chunk_bytes)):
            out.append({"key": f"{base}/{name}/{i}", "offset": off,
                        "size": min(chunk_bytes, len(data) - off)})
        return out

    def put_structured_object(self, payload: StructuredObjectPayload,
                              policy: BundleTransferPolicy | None = None, config: Any = None,
                              chunk_bytes: int | None = None) -> RemoteBundleRef:
        """Write one structured object; its ref."""
        if not isinstance(payload.metadata, dict):
            raise TypeError("metadata must be a dict")
        try:
            json.dumps(payload.metadata)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"metadata must be JSON-serializable: {exc}") from exc
        policy = policy or self.policy
        size = self.chunk_bytes if chunk_bytes is None else chunk_bytes
        if size <= 0:
            raise ValueError("chunk_bytes must be > 0")
        base = self._new_base()
        members, items = {}, []
        for name, value in payload.buffers.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"bad member name {name!r}")
            if policy.copy_mode == "zero_copy" and not isinstance(value, TensorObjectBuffer):
                raise ValueError("copy_mode='zero_copy' needs tensor_object_buffer payloads")
            spec, data = _member_spec(value.tensor() if isinstance(value, TensorObjectBuffer) else value)
            spec["nbytes"] = len(data)
            spec["chunks"] = self._chunks(base, _safe(name), data, size)
            members[name] = spec
            items += [(c["key"], data[c["offset"]:c["offset"] + c["size"]]) for c in spec["chunks"]]
        manifest = {"version": 1, "layout": "structured", "metadata": payload.metadata,
                    "buffers": members}
        key = f"{base}/manifest"
        self._write(items + [(key, memoryview(json.dumps(manifest).encode()))], config, policy)
        return RemoteBundleRef(key, manifest)

    def put_bundle(self, manifest: bytes, payloads: Mapping[str, Any],
                   chunk_bytes: int | None = None, config: Any = None) -> RemoteBundleRef:
        """Raw bytes ``manifest`` plus named byte payloads."""
        if not isinstance(manifest, (bytes, bytearray)):
            raise TypeError("a bundle manifest is bytes")
        size = self.chunk_bytes if chunk_bytes is None else chunk_bytes
        if size <= 0:
            raise ValueError("chunk_bytes must be > 0")
        base = self._new_base()
        members, items = {}, []
        for name, value in payloads.items():
            data = memoryview(bytes(value))
            chunks = self._chunks(base, _safe(name), data, size)
            members[name] = {"encoding": "bytes", "nbytes": len(data), "chunks": chunks}
            items += [(c["key"], data[c["offset"]:c["offset"] + c["size"]]) for c in chunks]
        doc = {"version": 1, "layout": "bundle", "meta": bytes(manifest).hex(), "buffers": members}
        key = f"{base}/manifest"
        self._write(items + [(key, memoryview(json.dumps(doc).encode()))], config, self.policy)
        return RemoteBundleRef(key, doc)

    def get_bundle(self, ref: RemoteBundleRef) -> tuple[bytes, dict[str, bytes]]:
        """(manifest bytes, name -> payload bytes) of a bundle."""
        doc = self._manifest(ref)
        out = {name: self._read_member_bytes(spec) for name, spec in doc["buffers"].items()}
        return bytes.fromhex(doc.get("meta", "")), out

    def remove_bundle(self, ref: RemoteBundleRef) -> None:
        """Remove a bundle's (or structured object's) payloads and manifest."""
        doc = self._manifest(ref)
        keys = [c["key"] for spec in doc["buffers"].values() for c in spec["chunks"]]
        self._remove_keys(keys + [ref.manifest_key])

    # -- reads ----------------------------------------------------------------------------------------
    def _manifest(self, ref: RemoteBundleRef) -> dict[str, Any]:
        if not ref.manifest:
            raw = self.store.get(ref.manifest_key)
            if not raw:
                raise KeyError(f"no manifest under {ref.manifest_key!r}")
            ref.manifest = json.loads(raw)
        doc = ref.manifest
        if not isinstance(doc, dict) or not isinstance(doc.get("buffers"), dict):
            raise ValueError(f"{ref.manifest_key!r} is not a bundle manifest")
        for spec in doc["buffers"].values():
            if sum(c["size"] for c in spec["chunks"]) != spec["nbytes"]:
                raise ValueError(f"{ref.manifest_key!r}: chunk sizes do not add up (tampered?)")
        return doc

    def read_spec(self, ref: RemoteBundleRef) -> StructuredObjectReadSpec:
        return StructuredObjectReadSpec(ref)

    def _read_range(self, spec: dict[str, Any], begin: int, end: int) -> bytes:
        """Bytes [begin, end) of one member: only the chunks that hold them."""
        chunks = [c for c in spec["chunks"] if c["offset"] < end and c["offset"] + c["size"] > begin]
        keys = [c["key"] for c in chunks]
        datas = (self.store.get_batch(keys) if hasattr(self.store, "get_batch")
                 else [self.store.get(k) for k in keys]) if keys else []
        parts = []
        for c, data in zip(chunks, datas):
            if len(data) != c["size"]:
                raise RuntimeError(f"chunk {c['key']!r} is missing or short")
            lo, hi = max(begin, c["offset"]) - c["offset"], min(end, c["offset"] + c["size"]) - c["offset"]
            parts.append(data[lo:hi])
        return b"".join(parts)

    def _read_member_bytes(self, spec: dict[str, Any]) -> bytes:
        return self._read_range(spec, 0, spec["nbytes"])

    def _member(self, spec: dict[str, Any], sl: StructuredMemberSlice | None) -> Any:
        enc = spec["encoding"]
        if enc == "bytes":
            if sl is not None:
                raise ValueError("byte members are read whole")
            return self._read_member_bytes(spec)
        dtype = np.dtype(spec["dtype"]) if enc == "ndarray" else torch_np_dtype(spec["dtype"])
        shape = list(spec["shape"])
        rows = range(shape[0]) if shape else range(0)
        if sl is not None:
            if not shape:
                raise ValueError("cannot slice a 0-d member")
            rows = rows[slice(sl.start, sl.end, sl.step)]
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize if shape else dtype.itemsize
        if sl is None or not rows:
            raw = self._read_member_bytes(spec) if sl is None else b""
            arr = np.frombuffer(raw, dtype).reshape(shape if sl is None else [0] + shape[1:]).copy()
        else:
            lo, hi = min(rows) * row_bytes, (max(rows) + 1) * row_bytes
            block = np.frombuffer(self._read_range(spec, lo, hi), dtype).reshape([-1] + shape[1:])
            arr = np.ascontiguousarray(block[[r - min(rows) for r in rows]])
        return to_torch(arr, spec["dtype"]) if enc == "tensor" else arr

    def materialize(self, spec: StructuredObjectReadSpec) -> MaterializeResult:
        """New objects for the members ``spec`` selects (slices applied)."""
        doc = self._manifest(spec.ref)
        names = list(spec.members) if spec.members is not None else list(doc["buffers"])
        missing = [n for n in names if n not in doc["buffers"]]
        if missing:
            raise KeyError(f"no members {missing} in {spec.ref.manifest_key!r}")
        objects = {n: self._member(doc["buffers"][n], spec.slices.get(n)) for n in names}
        return MaterializeResult(objects, self._metadata(doc))

    def materialize_into(self, spec: StructuredObjectReadSpec,
                         destinations: Mapping[str, np.ndarray]) -> MaterializeResult:
        """Fill caller-owned arrays (matching shape and dtype) with the selected members."""
        result = self.materialize(spec)
        for name, dst in destinations.items():
            value = result.objects.get(name)
            if value is None:
                raise KeyError(f"member {name!r} is not selected")
            src = value if isinstance(value, np.ndarray) else value.numpy()
            if not isinstance(dst, np.ndarray) or dst.shape != src.shape or dst.dtype != src.dtype:
                raise ValueError(f"destination for {name!r} must be {src.dtype} {src.shape}")
            dst[...] = src
            result.objects[name] = dst
        return result

    @staticmethod
    def _metadata(doc: dict[str, Any]) -> dict[str, Any]:
        fields = {}
        for name, spec in doc["buffers"].items():
            entry = {k: spec[k] for k in ("encoding", "dtype", "shape") if k in spec}
            fields[name] = entry
        return {"layout": doc.get("layout", "structured"), **doc.get("metadata", {}),
                FIELDS_KEY: fields}


class TensorObjectBuffer:
    """A serialized tensor object (``[header][data]``) in registered memory, as Mooncake's
    ``tensor_object_buffer(ptr, size, owner, batch_size=...)`` names it."""

    def __init__(self, ptr: int, size: int, owner: Any = None, batch_size: int | None = None) -> None:
        self.ptr, self.size, self.owner, self.batch_size = int(ptr), int(size), owner, batch_size

    def tensor(self) -> Any:
        from kvplane.compat import mooncake_tensor_format as fmt
        from kvplane.transfer.memory import view_at

        head = fmt.unpack(view_at(self.ptr, min(self.size, fmt.HEADER_SIZE)))
        if head is None or fmt.HEADER_SIZE + head.nbytes > self.size:
            raise ValueError("not a serialized tensor object")
        return fmt.tensor_from(head, bytearray(view_at(self.ptr + fmt.HEADER_SIZE, head.nbytes)))


def tensor_object_buffer(ptr: int, size: int, owner: Any = None,
                         batch_size: int | None = None) -> TensorObjectBuffer:
    return TensorObjectBuffer(ptr, size, owner, batch_size)


@dataclass
class RawDestination:
    """Caller memory to read into: ``ptr``, ``size``, the ``owner`` keeping it alive."""

    ptr: int
    size: int
    owner: Any = None
    pre_registered: bool = True


def raw_destination(ptr: int, size: int, owner: Any = None, pre_registered: bool = True) -> RawDestination:
    return RawDestination(int(ptr), int(size), owner, pre_registered)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:128] or "_"


def torch_np_dtype(name: str) -> np.dtype:
    """The numpy dtype with the byte size of a torch dtype (bytes are reinterpreted)."""
    from kvplane.compat import mooncake_tensor_format as fmt

    torch = fmt.torch()
    return np.dtype(f"V{torch.empty(0, dtype=getattr(torch, name)).element_size()}")


def to_torch(arr: np.ndarray, name: str) -> Any:
    from kvplane.compat import mooncake_tensor_format as fmt

    torch = fmt.torch()
    raw = torch.from_numpy(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).copy())
    return raw.view(getattr(torch, name)).reshape(arr.shape)
