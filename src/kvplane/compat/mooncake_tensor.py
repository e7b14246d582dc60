"""``MooncakeDistributedStore``'s tensor family: ``put_tensor``/``get_tensor`` and their batch,
``pub_`` (with a ReplicateConfig), upsert, ``_into``/``_from`` (zero-copy, registered buffers)
and tensor-parallel (``_with_tp``: shard ``r`` of a tensor lives under ``"{key}_tp_{r}"``)
forms, the safetensors helpers, and ``serialize_tensor`` & co.

Objects are ``[304-byte header][bytes]`` (``mooncake_tensor_format``). Writes return 0 or a
code; reads return a tensor or None. ``_into`` reads return a tensor that shares the caller's
buffer (after the header). torch is an optional extra: without it these calls raise
MissingExtra. CUDA tensors are copied through host memory (no GPU here to test the direct path).

A mixin of ``mooncake_store.MooncakeDistributedStore``; the unified ``*_with_parallelism``
calls are in ``mooncake_tensor_parallel``.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Sequence
from typing import Any

from kvplane.compat import mooncake_tensor_format as fmt
from kvplane.compat.mooncake_tensor_parallel import ParallelMixin
from kvplane.compat.mooncake_types import INVALID_PARAMS, OK, ReplicateConfig
from kvplane.transfer.memory import view_at

log = logging.getLogger(__name__)


def tp_key(key: str, rank: int) -> str:
    """Mooncake's name of TP shard ``rank`` of ``key``."""
    return f"{key}_tp_{rank}"


class TensorMixin(ParallelMixin):
    """See the module docstring."""

    _c: Any

    # -- plumbing ------------------------------------------------------------------------------------
    def _payload(self, tensor: Any, **layout: Any) -> bytes:
        return fmt.pack(fmt.header_for(tensor, **layout)) + fmt.tensor_bytes(tensor).tobytes()

    def _write_tensors(self, keys: Sequence[str], tensors: Sequence[Any], config: Any,
                       upsert: bool) -> list[int]:
        if self._c is None:
            return [INVALID_PARAMS] * len(keys)
        if len(keys) != len(tensors):
            return [INVALID_PARAMS] * len(keys)
        try:
            payloads = [self._payload(t) for t in tensors]
        except (ValueError, TypeError, AttributeError) as exc:
            log.error("tensor write: %s", exc)
            return [INVALID_PARAMS] * len(keys)
        return self._put_values(list(keys), payloads, config, upsert)  # type: ignore[attr-defined]  # mixin: the store class has it

    @staticmethod
    def _decode(data: bytes | None) -> Any:
        """A tensor from a stored object's bytes (None for a miss or a foreign object)."""
        if not data:
            return None
        head = fmt.unpack(data)
        if head is None or len(data) < fmt.HEADER_SIZE + head.nbytes:
            return None
        body = bytearray(memoryview(data)[fmt.HEADER_SIZE:fmt.HEADER_SIZE + head.nbytes])
        return fmt.tensor_from(head, body)

    def _decode_at(self, ptr: int, got: int) -> Any:
        """A tensor over a buffer ``get_into`` filled with ``got`` bytes at ``ptr``."""
        if got < fmt.HEADER_SIZE:
            return None
        view = view_at(int(ptr), got)
        head = fmt.unpack(view)
        if head is None or got < fmt.HEADER_SIZE + head.nbytes:
            return None
        return fmt.tensor_from(head, view_at(int(ptr) + fmt.HEADER_SIZE, max(head.nbytes, 1)))

    # -- put / get -----------------------------------------------------------------------------------
    def put_tensor(self, key: str, tensor: Any) -> int:
        """Store a tensor (an existing key is left as it is, as ``put``)."""
        return self._write_tensors([key], [tensor], None, False)[0]

    def pub_tensor(self, key: str, tensor: Any, config: ReplicateConfig | None = None) -> int:
        """``put_tensor`` with a ReplicateConfig."""
        return self._write_tensors([key], [tensor], config or ReplicateConfig(), False)[0]

    def upsert_tensor(self, key: str, tensor: Any) -> int:
        return self._write_tensors([key], [tensor], None, True)[0]

    def upsert_pub_tensor(self, key: str, tensor: Any, config: ReplicateConfig | None = None) -> int:
        return self._write_tensors([key], [tensor], config or ReplicateConfig(), True)[0]

    def batch_put_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any]) -> list[int]:
        return self._write_tensors(keys, tensors_list, None, False)

    def batch_pub_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any],
                         config: ReplicateConfig | None = None) -> list[int]:
        return self._write_tensors(keys, tensors_list, config or ReplicateConfig(), False)

    def batch_upsert_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any]) -> list[int]:
        return self._write_tensors(keys, tensors_list, None, True)

    def batch_upsert_pub_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any],
                                config: ReplicateConfig | None = None) -> list[int]:
        return self._write_tensors(keys, tensors_list, config or ReplicateConfig(), True)

    def get_tensor(self, key: str) -> Any:
        """The tensor under ``key``, or None."""
        return self.batch_get_tensor([key])[0]

    def batch_get_tensor(self, keys: Sequence[str]) -> list[Any]:
        fmt.torch()
        return [self._decode(d) for d in self.get_batch(list(keys))]  # type: ignore[attr-defined]  # mixin

    # -- zero-copy ------------------------------------------------------------------------------------
    def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> Any:
        """Read into registered memory; a tensor sharing that buffer (after the header), or None."""
        got = self.batch_get_tensor_into([key], [buffer_ptr], [size])[0]
        return None if isinstance(got, int) else got

    def batch_get_tensor_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                              sizes: Sequence[int]) -> list[Any]:
        fmt.torch()
        if self._c is None or not len(keys) == len(buffer_ptrs) == len(sizes) or \
                any(int(p) == 0 for p in buffer_ptrs):
            return [INVALID_PARAMS] * len(keys)  # the whole call is refused (per-key misses: None)
        got = self.batch_get_into(list(keys), buffer_ptrs, sizes)  # type: ignore[attr-defined]  # mixin
        return [self._decode_at(p, n) if n > 0 else None for p, n in zip(buffer_ptrs, got)]

    def _check_serialized(self, ptr: int, size: int) -> bool:
        try:
            head = fmt.unpack(self._view(ptr, min(int(size), fmt.HEADER_SIZE)))  # type: ignore[attr-defined]  # mixin: the store class has it
        except Exception:
            return False
        return head is not None and fmt.HEADER_SIZE + head.nbytes <= int(size)

    def _put_tensor_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int],
                         upsert: bool) -> list[int]:
        if self._c is None or not len(keys) == len(ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        ok = [self._check_serialized(p, n) for p, n in zip(ptrs, sizes)]
        out = [INVALID_PARAMS] * len(keys)
        idx = [i for i, good in enumerate(ok) if good]
        if idx:
            codes = self._put_from([keys[i] for i in idx], [ptrs[i] for i in idx],  # type: ignore[attr-defined]  # mixin: the store class has it
                                   [sizes[i] for i in idx], None, upsert)
            for i, rc in zip(idx, codes):
                out[i] = rc
        return out

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """Store ``[header][data]`` from registered memory (the layout ``get_tensor_into`` fills)."""
        return self._put_tensor_from([key], [buffer_ptr], [size], False)[0]

    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self._put_tensor_from([key], [buffer_ptr], [size], True)[0]

    def batch_put_tensor_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                              sizes: Sequence[int]) -> list[int]:
        return self._put_tensor_from(keys, buffer_ptrs, sizes, False)

    def batch_upsert_tensor_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                                 sizes: Sequence[int]) -> list[int]:
        return self._put_tensor_from(keys, buffer_ptrs, sizes, True)

    def get_tensor_into_cuda(self, key: str, tensor: Any) -> int:
        """Copy the stored tensor's bytes into ``tensor`` (any device); bytes copied or a code."""
        return self.batch_get_tensor_into_cuda([key], [tensor])[0]

    def batch_get_tensor_into_cuda(self, keys: Sequence[str], tensors_list: Sequence[Any]) -> list[int]:
        out = []
        for stored, dst in zip(self.batch_get_tensor(keys), tensors_list):
            if stored is None:
                out.append(-704)
            elif stored.numel() * stored.element_size() > dst.numel() * dst.element_size():
                out.append(INVALID_PARAMS)
            else:
                flat = dst.view(-1).view(fmt.torch().uint8)
                src = stored.contiguous().view(-1).view(fmt.torch().uint8)
                flat[:src.numel()].copy_(src)
                out.append(int(src.numel()))
        return out

    # -- tensor parallel (legacy wrappers) --------------------------------------------------------------
    def _tp_shards(self, tensor: Any, tp_size: int, split_dim: int) -> list[Any] | None:
        if tp_size < 1 or not -tensor.dim() <= split_dim < max(tensor.dim(), 1):
            return None
        shards = list(tensor.chunk(tp_size, split_dim))
        return shards if len(shards) == tp_size else None

    def _write_tp(self, key: str, tensor: Any, config: Any, tp_size: int, split_dim: int,
                  upsert: bool = False) -> int:
        if tp_size <= 1:
            return self._write_tensors([key], [tensor], config, upsert)[0]
        shards = self._tp_shards(tensor, tp_size, split_dim)
        if shards is None:
            return INVALID_PARAMS
        gshape = tuple(int(d) for d in tensor.shape)
        payloads = [fmt.pack(fmt.header_for(s, global_shape=gshape, tp_size=tp_size, tp_rank=r,
                                            split_dim=split_dim % tensor.dim()))
                    + fmt.tensor_bytes(s).tobytes() for r, s in enumerate(shards)]
        codes = self._put_values([tp_key(key, r) for r in range(tp_size)], payloads,  # type: ignore[attr-defined]  # mixin: the store class has it
                                 config, upsert)
        return next((c for c in codes if c), OK)

    def put_tensor_with_tp(self, key: str, tensor: Any, tp_rank: int = 0, tp_size: int = 1,
                           split_dim: int = 0) -> int:
        """Cut ``tensor`` into ``tp_size`` shards along ``split_dim`` and store every one under
        ``"{key}_tp_{r}"`` (as Mooncake does, whatever ``tp_rank`` says)."""
        return self._write_tp(key, tensor, None, int(tp_size), int(split_dim))

    def pub_tensor_with_tp(self, key: str, tensor: Any, config: ReplicateConfig | None = None,
                           tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> int:
        return self._write_tp(key, tensor, config or ReplicateConfig(), int(tp_size), int(split_dim))

    def batch_put_tensor_with_tp(self, base_keys: Sequence[str], tensors_list: Sequence[Any],
                                 tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> list[int]:
        return [self._write_tp(k, t, None, int(tp_size), int(split_dim))
                for k, t in zip(base_keys, tensors_list)]

    def batch_pub_tensor_with_tp(self, base_keys: Sequence[str], tensors_list: Sequence[Any],
                                 config: ReplicateConfig | None = None, tp_rank: int = 0,
                                 tp_size: int = 1, split_dim: int = 0) -> list[int]:
        cfg = config or ReplicateConfig()
        return [self._write_tp(k, t, cfg, int(tp_size), int(split_dim))
                for k, t in zip(base_keys, tensors_list)]

    def get_tensor_with_tp(self, key: str, tp_rank: int = 0, tp_size: int = 1,
                           split_dim: int = 0) -> Any:
        """Shard ``tp_rank`` (``"{key}_tp_{rank}"``), or the whole tensor when ``tp_size`` <= 1."""
        return self.get_tensor(key if tp_size <= 1 else tp_key(key, tp_rank))

    def batch_get_tensor_with_tp(self, base_keys: Sequence[str], tp_rank: int = 0,
                                 tp_size: int = 1) -> list[Any]:
        keys = list(base_keys) if tp_size <= 1 else [tp_key(k, tp_rank) for k in base_keys]
        return self.batch_get_tensor(keys)

    def get_tensor_with_tp_into(self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0,
                                tp_size: int = 1, split_dim: int = 0) -> Any:
        return self.get_tensor_into(key if tp_size <= 1 else tp_key(key, tp_rank), buffer_ptr, size)

    def batch_get_tensor_with_tp_into(self, base_keys: Sequence[str], buffer_ptrs: Sequence[int],
                                      sizes: Sequence[int], tp_rank: int = 0,
                                      tp_size: int = 1) -> list[Any]:
        keys = list(base_keys) if tp_size <= 1 else [tp_key(k, tp_rank) for k in base_keys]
        return self.batch_get_tensor_into(keys, buffer_ptrs, sizes)

    def _tensor_at(self, ptr: int, size: int) -> Any:
        """The tensor serialized at registered ``ptr`` (a copy), or None."""
        if not self._check_serialized(ptr, size):
            return None
        head = fmt.unpack(self._view(ptr, fmt.HEADER_SIZE))  # type: ignore[attr-defined]  # mixin
        body = bytearray(self._view(int(ptr) + fmt.HEADER_SIZE, head.nbytes)) if head.nbytes else b""  # type: ignore[attr-defined,union-attr]  # mixin: the store class has it
        return fmt.tensor_from(head, body)  # type: ignore[arg-type]  # bytes or bytearray

    def put_tensor_with_tp_from(self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0,
                                tp_size: int = 1, split_dim: int = 0) -> int:
        """``put_tensor_with_tp`` of the full tensor serialized at ``buffer_ptr``."""
        tensor = self._tensor_at(buffer_ptr, size)
        if tensor is None:
            return INVALID_PARAMS
        return self._write_tp(key, tensor, None, int(tp_size), int(split_dim))

    def batch_put_tensor_with_tp_from(self, base_keys: Sequence[str], buffer_ptrs: Sequence[int],
                                      sizes: Sequence[int], tp_rank: int = 0, tp_size: int = 1,
                                      split_dim: int = 0) -> list[int]:
        return [self.put_tensor_with_tp_from(k, p, n, tp_rank, tp_size, split_dim)
                for k, p, n in zip(base_keys, buffer_ptrs, sizes)]

    # -- safetensors -----------------------------------------------------------------------------------
    def save_tensor_to_safetensor(self, key: str, file_name: str | None = None) -> int:
        """Write the tensor under ``key`` to a safetensors file (default name: the key)."""
        tensor = self.get_tensor(key)
        if tensor is None:
            return -704
        path = file_name if file_name is not None else key
        try:
            write_safetensors(path, {key: tensor})
        except (OSError, ValueError) as exc:
            log.error("save_tensor_to_safetensor(%s): %s", key, exc)
            return INVALID_PARAMS
        return OK

    def load_tensor_from_safetensor(self, key: str | None = None,
                                    file_name: str | None = None) -> Any:
        """Read a tensor from a safetensors file and put it under ``key`` (default: the file
        name); the file's tensor named ``key``, else its first one. The tensor, or None."""
        if file_name is None:
            raise TypeError("load_tensor_from_safetensor(): file_name is required")
        try:
            tensors = read_safetensors(file_name)
        except (OSError, ValueError) as exc:
            log.error("load_tensor_from_safetensor(%s): %s", file_name, exc)
            return None
        if not tensors:
            return None
        store_key = key if key is not None else file_name
        tensor = tensors.get(store_key)
        if tensor is None:
            log.warning("%s has no tensor named %r: using its first", file_name, store_key)
            tensor = next(iter(tensors.values()))
        rc = self.upsert_tensor(store_key, tensor)
        return tensor if rc == 0 else None


# -- safetensors files (the public format: u64 header length, JSON header, raw data) ----------------
_ST_DTYPES = {"float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16",
              "int8": "I8", "uint8": "U8", "int16": "I16", "int32": "I32", "int64": "I64",
              "uint16": "U16", "uint32": "U32", "uint64": "U64", "bool": "BOOL",
              "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}


def write_safetensors(path: str, tensors: dict[str, Any]) -> None:
    header: dict[str, Any] = {}
    blobs, offset = [], 0
    for name, tensor in tensors.items():
        code = _ST_DTYPES.get(str(tensor.dtype).removeprefix("torch."))
        if code is None:
            raise ValueError(f"safetensors has no dtype for {tensor.dtype}")
        data = fmt.tensor_bytes(tensor).tobytes()
        header[name] = {"dtype": code, "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for blob in blobs:
            f.write(blob)
    os.replace(tmp, path)


def read_safetensors(path: str) -> dict[str, Any]:
    torch = fmt.torch()
    names = {v: k for k, v in _ST_DTYPES.items()}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 << 20:
            raise ValueError(f"{path}: header of {n} bytes")
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = getattr(torch, names[info["dtype"]])
        body = bytearray(data[begin:end])
        out[name] = (torch.frombuffer(body, dtype=torch.uint8).view(dtype).reshape(info["shape"])
                     if body else torch.empty(info["shape"], dtype=dtype))
    return out


# -- module helpers Mooncake's extension exposes -----------------------------------------------------
def tensor_metadata_size() -> int:
    """Bytes of the header in front of a stored tensor's data."""
    return fmt.HEADER_SIZE


def serialize_tensor(tensor: Any) -> tuple[bytes, int, int, Any]:
    """(header bytes, data address, data size, owner keeping the data alive) of a tensor."""
    data = fmt.tensor_bytes(tensor)
    owner = data.obj if hasattr(data, "obj") else data
    addr = __import__("numpy").frombuffer(data, "u1").ctypes.data if len(data) else 0
    return fmt.pack(fmt.header_for(tensor)), int(addr), len(data), owner


def deserialize_tensor(payload: bytes) -> Any:
    """The tensor of ``header + data`` bytes (ValueError when they are not one)."""
    tensor = TensorMixin._decode(payload)
    if tensor is None:
        raise ValueError("not a serialized tensor")
    return tensor
