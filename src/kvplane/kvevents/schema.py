"""vLLM's KV-cache event schema, declared once: field tables from which every wire form is built.

vLLM has shipped two encodings of the same events: positional arrays
(``["BlockStored", block_hashes, parent, token_ids, ...]``) and, since PR #42892, tagged maps
(``{"type": "BlockStored", ...}``). A batch is always the array ``[ts, events, dp_rank]``. The
tables below list each event's fields in wire order; :func:`event_types` turns a table into
msgspec structs for one encoding, either for *writing* (the fields vLLM always emits have no
default, so they are never omitted) or for *reading* (every field but ``block_hashes`` has a
default, so older and newer publishers both decode; ``token_ids`` and ``extra_keys`` stay raw
msgpack until asked for, which keeps ingest fast).

Also the vocabulary of the ``medium`` field (:class:`Tier`, :func:`tier_of`).

Pure: no sockets, no clocks. Must not import zmq or any kvplane component.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, Literal, NamedTuple, Union

import msgspec

Hash = Union[int, bytes]
Encoding = Literal["map", "array"]
_NO_DEFAULT: Any = msgspec.NODEFAULT


class Field(NamedTuple):
    """One event field: wire name, type, default, and whether vLLM always writes it."""

    name: str
    type: Any
    default: Any = None
    always_written: bool = False


# Fields in wire order (vLLM 0.32; each later field was appended by a vLLM release).
STORED_FIELDS: tuple[Field, ...] = (
    Field("block_hashes", list[Hash], _NO_DEFAULT, True),
    Field("parent_block_hash", Union[Hash, None], None, True),
    Field("token_ids", list[int], msgspec.field(default_factory=list), True),
    Field("block_size", int, 0, True),
    Field("lora_id", Union[int, None], None, True),  # deprecated in vLLM, always nil
    Field("medium", Union[str, None], None, True),
    Field("lora_name", Union[str, None], None, True),
    Field("extra_keys", Union[list[tuple[object, ...] | None], None]),
    Field("group_idx", Union[int, None]),
    Field("kv_cache_spec_kind", Union[str, None]),
    Field("kv_cache_spec_sliding_window", Union[int, None]),
)
REMOVED_FIELDS: tuple[Field, ...] = (
    Field("block_hashes", list[Hash], _NO_DEFAULT, True),
    Field("medium", Union[str, None], None, True),
    Field("group_idx", Union[int, None]),
)
CLEARED_FIELDS: tuple[Field, ...] = ()
EVENT_TABLES: dict[str, tuple[Field, ...]] = {
    "BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS,
    "AllBlocksCleared": CLEARED_FIELDS,
}
# Read as raw msgpack (decoded on demand): (name -> (type, default)).
_LAZY = {"token_ids": msgspec.Raw(b"\x90"), "extra_keys": msgspec.Raw(b"\xc0")}


class EventTypes(NamedTuple):
    """The structs of one encoding: stored, removed, cleared, and the batch."""

    stored: type[msgspec.Struct]
    removed: type[msgspec.Struct]
    cleared: type[msgspec.Struct]
    batch: type[msgspec.Struct]


def _fields(table: tuple[Field, ...], reading: bool) -> list[tuple[str, Any, Any]]:
    out: list[tuple[str, Any, Any]] = []
    for f in table:
        if reading and f.name in _LAZY:
            out.append((f.name, msgspec.Raw, _LAZY[f.name]))
        elif f.always_written and not reading:
            out.append((f.name, f.type))  # type: ignore[arg-type]  # a type object at run time
        else:
            out.append((f.name, f.type, f.default))
    return out


def event_types(encoding: Encoding, reading: bool) -> EventTypes:
    """Build the structs of one encoding from the tables.

    Args:
        encoding: ``map`` (tagged maps, ``"type"`` key) or ``array`` (positional, tag first).
        reading: True for tolerant decoder structs, False for vLLM-exact encoder structs.
    """
    opts: dict[str, Any] = {"gc": False, "omit_defaults": not reading}
    if encoding == "array":
        opts["array_like"] = True
    else:
        opts["tag_field"] = "type"
    kinds = [msgspec.defstruct(f"{name}_{encoding}{'_r' if reading else ''}",
                               _fields(table, reading), tag=name, **opts)
             for name, table in EVENT_TABLES.items()]
    union: Any = Union[tuple(kinds)]  # built at run time: a value to mypy, not a type
    batch = msgspec.defstruct(
        f"Batch_{encoding}{'_r' if reading else ''}",
        [("ts", float), ("events", list[union]), ("data_parallel_rank", Union[int, None], None)],
        array_like=True, gc=False, omit_defaults=not reading)
    return EventTypes(kinds[0], kinds[1], kinds[2], batch)


class Tier(IntEnum):
    """Where a block lives: Mooncake's G1 device, G2 host memory, G3 disk."""

    GPU = 0
    CPU = 1
    DISK = 2


_MEDIUM_TIERS = {
    "gpu": Tier.GPU, "cuda": Tier.GPU, "device": Tier.GPU, "hbm": Tier.GPU, "npu": Tier.GPU,
    "xpu": Tier.GPU,
    "cpu": Tier.CPU, "dram": Tier.CPU, "host": Tier.CPU, "memory": Tier.CPU, "mem": Tier.CPU,
    "ram": Tier.CPU, "cpu_tier": Tier.CPU,
    "disk": Tier.DISK, "ssd": Tier.DISK, "nvme": Tier.DISK, "file": Tier.DISK, "3fs": Tier.DISK,
    "dfs": Tier.DISK, "nfs": Tier.DISK, "localdisk": Tier.DISK,
}


def tier_of(medium: str | None) -> Tier | None:
    """Map an event's ``medium`` to a tier (None/absent means the engine's own GPU cache).

    Returns:
        The tier, or None for a medium this module does not know (the caller counts it).
    """
    if medium is None:
        return Tier.GPU
    return _MEDIUM_TIERS.get(medium.strip().lower())
