"""Decoding of vLLM KV-cache event batches, in both encodings vLLM has shipped.

A ZMQ message is ``[topic, seq (8-byte big-endian), payload]``; the payload is a msgpack
``KVEventBatch``: an array ``[ts, events, data_parallel_rank]`` (or, from one vLLM build, a map
with those keys). Each event is either a tagged map (``{"type": "BlockStored", ...}``, vLLM after
PR #42892) or a positional array (``["BlockStored", block_hashes, parent, token_ids, ...]``,
before it). Unknown keys and trailing fields are ignored; hashes arrive as u64, i64 or raw
digest bytes and are normalised to the 64-bit event projection.

Pure: no sockets, no clocks. Must not import ``zmq`` or the HTTP stack.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Union

import msgspec

from kvplane.common.errors import ProtocolError
from kvplane.conductor.hashing import to_event_hash

SEQ_BYTES = 8
END_OF_REPLAY = -1


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
        The tier, or None for a medium this conductor does not know (the caller counts it).
    """
    if medium is None:
        return Tier.GPU
    return _MEDIUM_TIERS.get(medium.strip().lower())


Hash = Union[int, bytes]


class _StoredMap(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None = None
    token_ids: msgspec.Raw = msgspec.Raw(b"\x90")
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: msgspec.Raw = msgspec.Raw(b"\xc0")
    group_idx: int | None = None


class _RemovedMap(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None


class _ClearedMap(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    pass


class _StoredArr(msgspec.Struct, tag="BlockStored", array_like=True, gc=False):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None = None
    token_ids: msgspec.Raw = msgspec.Raw(b"\x90")
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: msgspec.Raw = msgspec.Raw(b"\xc0")
    group_idx: int | None = None


class _RemovedArr(msgspec.Struct, tag="BlockRemoved", array_like=True, gc=False):
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None


class _ClearedArr(msgspec.Struct, tag="AllBlocksCleared", array_like=True, gc=False):
    pass


_MapEvent = Union[_StoredMap, _RemovedMap, _ClearedMap]
_ArrEvent = Union[_StoredArr, _RemovedArr, _ClearedArr]


class _ArrBatchOfMaps(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_MapEvent]
    data_parallel_rank: int | None = None


class _ArrBatchOfArrs(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_ArrEvent]
    data_parallel_rank: int | None = None


class _ArrBatchOfRaw(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _MapBatchOfRaw(msgspec.Struct, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_DEC_MAPS = msgspec.msgpack.Decoder(_ArrBatchOfMaps)
_DEC_ARRS = msgspec.msgpack.Decoder(_ArrBatchOfArrs)
_DEC_ARR_RAW = msgspec.msgpack.Decoder(_ArrBatchOfRaw)
_DEC_MAP_RAW = msgspec.msgpack.Decoder(_MapBatchOfRaw)
_DEC_EV_MAP = msgspec.msgpack.Decoder(_MapEvent)
_DEC_EV_ARR = msgspec.msgpack.Decoder(_ArrEvent)
_DEC_TOKENS = msgspec.msgpack.Decoder(list[int])
_DEC_ANY = msgspec.msgpack.Decoder()


@dataclass(slots=True)
class BlockStored:
    """Blocks newly cached by an engine (consecutive in one chain).

    Attributes:
        hashes: 64-bit event hashes, in chain order.
        parent: the event hash of the block before the first one, None at the root.
        medium: the raw medium string (None = the engine's GPU cache).
        block_size: tokens per block as the engine reports it (0 if absent).
        lora_name: the adapter name, if any.
        group_idx: KV cache group (hybrid models); None or 0 for full attention.
        raw_tokens: undecoded msgpack of ``token_ids`` (see :func:`tokens_of`).
        raw_extra_keys: undecoded msgpack of ``extra_keys``.
    """

    hashes: list[int]
    parent: int | None
    medium: str | None
    block_size: int
    lora_name: str | None
    group_idx: int | None
    raw_tokens: bytes
    raw_extra_keys: bytes


@dataclass(slots=True)
class BlockRemoved:
    """Blocks evicted from one medium of an engine."""

    hashes: list[int]
    medium: str | None
    group_idx: int | None


@dataclass(slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache (``reset_prefix_cache``)."""


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(slots=True)
class EventBatch:
    """One decoded publisher batch: wall time, events, and the DP rank that produced them."""

    ts: float
    events: list[Event]
    dp_rank: int | None


def _hashes(values: list[Hash]) -> list[int]:
    return [v & 0xFFFFFFFFFFFFFFFF if isinstance(v, int) else to_event_hash(v) for v in values]


def _convert(ev: object) -> Event:
    if isinstance(ev, _StoredMap | _StoredArr):
        parent = None if ev.parent_block_hash is None else to_event_hash(ev.parent_block_hash)
        return BlockStored(_hashes(ev.block_hashes), parent, ev.medium, ev.block_size,
                           ev.lora_name, ev.group_idx, bytes(ev.token_ids), bytes(ev.extra_keys))
    if isinstance(ev, _RemovedMap | _RemovedArr):
        return BlockRemoved(_hashes(ev.block_hashes), ev.medium, ev.group_idx)
    return AllBlocksCleared()


def _decode_mixed(payload: bytes) -> tuple[float, list[object], int | None]:
    first = payload[:1]
    raw = (_DEC_MAP_RAW if first and (0x80 <= first[0] <= 0x8F or first[0] in (0xDE, 0xDF))
           else _DEC_ARR_RAW).decode(payload)
    events: list[object] = []
    for item in raw.events:
        b = bytes(item)[:1]
        is_map = bool(b) and (0x80 <= b[0] <= 0x8F or b[0] in (0xDE, 0xDF))
        events.append((_DEC_EV_MAP if is_map else _DEC_EV_ARR).decode(item))
    return raw.ts, events, raw.data_parallel_rank


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one msgpack batch in either encoding (per batch and per event).

    Raises:
        ProtocolError: when the payload is not a valid batch in any known encoding.
    """
    batch: _ArrBatchOfMaps | _ArrBatchOfArrs | None = None
    for dec in (_DEC_MAPS, _DEC_ARRS):
        try:
            batch = dec.decode(payload)
            break
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
    try:
        if batch is not None:
            ts, events, rank = batch.ts, list(batch.events), batch.data_parallel_rank
        else:
            ts, events, rank = _decode_mixed(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"undecodable KV event batch: {exc}") from exc
    return EventBatch(ts, [_convert(e) for e in events], rank)


def tokens_of(ev: BlockStored) -> list[int]:
    """Decode the token ids carried by a stored event.

    Raises:
        ProtocolError: if they are not a list of ints.
    """
    try:
        return _DEC_TOKENS.decode(ev.raw_tokens)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"bad token_ids in BlockStored: {exc}") from exc


def extra_keys_of(ev: BlockStored) -> list[tuple[object, ...] | None] | None:
    """Decode per-block extra keys (msgpack arrays become tuples, as vLLM hashed them).

    Raises:
        ProtocolError: if the field is not a list (or nil).
    """
    try:
        value = _DEC_ANY.decode(ev.raw_extra_keys)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"bad extra_keys in BlockStored: {exc}") from exc
    if value is None:
        return None
    if not isinstance(value, list):
        raise ProtocolError("extra_keys must be a list")
    return [None if k is None else _as_tuple(k) for k in value]


def _as_tuple(value: object) -> tuple[object, ...]:
    if isinstance(value, list):
        return tuple(_as_tuple(v) if isinstance(v, list) else v for v in value)
    return (value,)


def decode_seq(frame: bytes) -> int:
    """Parse the 8-byte big-endian sequence frame (signed, so the replay end marker is -1).

    Raises:
        ProtocolError: when the frame is not exactly 8 bytes.
    """
    if len(frame) != SEQ_BYTES:
        raise ProtocolError(f"sequence frame must be {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
