"""The stored form of a tensor for the Mooncake tensor calls, and the parallelism value types.

An object is ``[header 304 bytes][tensor bytes]``; 304 is the size Mooncake's format has
(``TensorObjectHeader`` 40 + ``TensorLayoutMetadata`` 264), so callers that size buffers as
``304 + numel * element_size`` (Mooncake's tests do) size them right. The layout of the 304
bytes is kvplane's own (little endian)::

    magic "KVTS" | version u16 | header_size u16 | dtype i32 | ndim i32 | data_nbytes u64 |
    tp_size i32 | tp_rank i32 | split_dim i32 | reserved i32                        (40 bytes)
    global_shape 8 x i64 | local_shape 8 x i64 | axis_count u32 | reserved u32 |
    4 axes x (kind i32, rank i32, size i32, split_dim i32, expert_id i64, stage_id i64)  (264)

``tp_size``/``tp_rank``/``split_dim`` say how a TP shard was cut from its full tensor
(``global_shape``), so a full tensor is rebuilt from its shards without any other object.

``ParallelAxis``, ``TensorParallelism`` and ``ReadTarget`` are Mooncake's value types for the
unified parallel tensor calls. torch is imported only by the functions that need it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from kvplane.common.extras import require

MAGIC = b"KVTS"
VERSION = 1
HEADER_SIZE = 304
MAX_DIMS = 8
MAX_AXES = 4
_HEAD = struct.Struct("<4sHHiiQiiii")
_AXIS = struct.Struct("<iiiiqq")
_LAYOUT_HEAD = struct.Struct("<8q8qII")
KINDS = ("tp", "dp", "ep", "pp")
NONE = -1  # an unset optional field (split_dim, expert_id, stage_id)
# dtype codes (kvplane's own numbering)
_DTYPES = ("float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool", "float16",
           "bfloat16", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
           "complex64", "complex128")


def torch() -> Any:
    """The torch module, or MissingExtra naming ``pip install 'kvplane[torch]'``."""
    return require("torch", "torch", "the tensor calls")


def dtype_code(dtype: Any) -> int:
    """The code of a torch dtype (ValueError for one this format does not carry)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported tensor dtype {dtype}")
    return _DTYPES.index(name)


def dtype_of(code: int) -> Any:
    if not 0 <= code < len(_DTYPES) or not hasattr(torch(), _DTYPES[code]):
        raise ValueError(f"unknown dtype code {code}")
    return getattr(torch(), _DTYPES[code])


# -- parallelism value types ---------------------------------------------------------------------
class ParallelAxis:
    """One axis of a shard's identity: ``kind`` ("tp", "dp", "ep", "pp"), ``rank``, ``size``,
    and the optional ``split_dim`` (layout-sharding axes: TP), ``expert_id`` (EP),
    ``stage_id`` (PP)."""

    def __init__(self) -> None:
        self.kind = "tp"
        self.rank = 0
        self.size = 1
        self.split_dim: int | None = None
        self.expert_id: int | None = None
        self.stage_id: int | None = None

    def __repr__(self) -> str:
        return (f"ParallelAxis(kind={self.kind!r}, rank={self.rank}, size={self.size}, "
                f"split_dim={self.split_dim}, expert_id={self.expert_id}, "
                f"stage_id={self.stage_id})")


class TensorParallelism:
    """An ordered list of ``ParallelAxis`` naming one stored (or requested) shard."""

    def __init__(self) -> None:
        self.axes: list[ParallelAxis] = []

    def __repr__(self) -> str:
        return f"TensorParallelism(axes={self.axes!r})"


class ReadTarget:
    """What a read materialises: ``mode`` "as_stored", "shard" (``parallelism`` required)
    or "full"."""

    def __init__(self) -> None:
        self.mode = "as_stored"
        self.parallelism: TensorParallelism | None = None


def check_axes(axes: list[Any]) -> str:
    """"" when the axes are valid, else why not. Rules (Mooncake's): known, distinct kinds;
    0 <= rank < size; TP has a split_dim, DP/EP/PP have none; EP names its expert_id."""
    seen = set()
    for a in axes:
        kind = getattr(a, "kind", None)
        if kind not in KINDS or kind in seen:
            return f"bad or repeated axis kind {kind!r}"
        seen.add(kind)
        if not (isinstance(a.size, int) and isinstance(a.rank, int) and 0 <= a.rank < a.size):
            return f"axis {kind}: rank {a.rank} not in [0, {a.size})"
        split = getattr(a, "split_dim", None)
        if kind == "tp" and (split is None or split < 0):
            return "a tp axis needs split_dim >= 0"
        if kind != "tp" and split is not None:
            return f"a {kind} axis has no split_dim"
        if kind == "ep" and getattr(a, "expert_id", None) is None:
            return "an ep axis needs expert_id"
    return ""


# -- header ----------------------------------------------------------------------------------------
@dataclass
class Header:
    """The parsed header of a stored tensor."""

    dtype: int
    shape: tuple[int, ...]
    nbytes: int
    global_shape: tuple[int, ...] = ()
    tp_size: int = 1
    tp_rank: int = 0
    split_dim: int = NONE
    axes: list[tuple[str, int, int, int, int, int]] = field(default_factory=list)


def _dims(shape: tuple[int, ...]) -> list[int]:
    if len(shape) > MAX_DIMS:
        raise ValueError(f"tensors of more than {MAX_DIMS} dimensions are not supported")
    return list(shape) + [NONE] * (MAX_DIMS - len(shape))


def pack(h: Header) -> bytes:
    """The 304 header bytes of ``h``."""
    if len(h.axes) > MAX_AXES:
        raise ValueError(f"at most {MAX_AXES} parallel axes")
    head = _HEAD.pack(MAGIC, VERSION, HEADER_SIZE, h.dtype, len(h.shape), h.nbytes, h.tp_size,
                      h.tp_rank, h.split_dim, 0)
    layout = _LAYOUT_HEAD.pack(*_dims(h.global_shape or h.shape), *_dims(h.shape), len(h.axes), 0)
    axes = b"".join(_AXIS.pack(KINDS.index(k), r, s, d, e, st) for k, r, s, d, e, st in h.axes)
    out = head + layout + axes
    return out + bytes(HEADER_SIZE - len(out))


def unpack(data: bytes | memoryview) -> Header | None:
    """The header at the start of ``data``, or None when it is not one of ours."""
    if len(data) < HEADER_SIZE:
        return None
    magic, version, size, dtype, ndim, nbytes, tp_size, tp_rank, split, _ = \
        _HEAD.unpack_from(data, 0)
    if magic != MAGIC or size != HEADER_SIZE or not 0 <= ndim <= MAX_DIMS:
        return None
    dims = _LAYOUT_HEAD.unpack_from(data, _HEAD.size)
    gshape = tuple(d for d in dims[:MAX_DIMS] if d >= 0)
    shape = tuple(dims[MAX_DIMS:MAX_DIMS + ndim])
    n_axes = min(dims[2 * MAX_DIMS], MAX_AXES)
    axes = []
    for i in range(n_axes):
        k, r, s, d, e, st = _AXIS.unpack_from(data, _HEAD.size + _LAYOUT_HEAD.size + i * _AXIS.size)
        axes.append((KINDS[k], r, s, d, e, st))
    return Header(dtype, shape, nbytes, gshape, tp_size, tp_rank, split, axes)


def axes_tuple(parallelism: Any) -> list[tuple[str, int, int, int, int, int]]:
    """The header form of a TensorParallelism (None: no axes)."""
    if parallelism is None:
        return []
    out = []
    for a in parallelism.axes:
        def opt(v: Any) -> int:
            return NONE if v is None else int(v)
        out.append((a.kind, int(a.rank), int(a.size), opt(a.split_dim),
                    opt(getattr(a, "expert_id", None)), opt(getattr(a, "stage_id", None))))
    return out


# -- tensors <-> bytes ---------------------------------------------------------------------------
def tensor_bytes(tensor: Any) -> memoryview:
    """The bytes of a CPU tensor (made contiguous), without a copy when it already is."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch().uint8).numpy()).cast("B")


def header_for(tensor: Any, **layout: Any) -> Header:
    return Header(dtype_code(tensor.dtype), tuple(int(d) for d in tensor.shape),
                  tensor.numel() * tensor.element_size(), **layout)


def tensor_from(h: Header, data: Any) -> Any:
    """A tensor of ``h``'s dtype and shape over ``data`` (a buffer of ``h.nbytes``; shared)."""
    t = torch()
    dtype = dtype_of(h.dtype)
    if h.nbytes == 0:
        return t.empty(h.shape, dtype=dtype)
    raw = t.frombuffer(data, dtype=t.uint8, count=h.nbytes)
    return raw.view(dtype).reshape(h.shape)
