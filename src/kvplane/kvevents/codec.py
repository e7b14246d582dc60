"""Encoding and decoding of vLLM KV-event batches, in both encodings vLLM has shipped.

A ZMQ message is ``[topic, seq (8-byte big-endian), payload]``; the payload is a msgpack batch
``[ts, events, data_parallel_rank]`` (one vLLM build sent a map with those keys). Events are
tagged maps or positional arrays (see :mod:`kvplane.kvevents.schema`); a decoder accepts both,
per batch and per event, ignores unknown keys and trailing fields, and normalises hashes (u64,
i64 or raw digest bytes) to the 64-bit event projection.

Pure: no sockets, no clocks (the publisher stamps each batch's wall time). Must not import zmq
or any kvplane component except ``common.errors``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

import msgspec

from kvplane.common.errors import ProtocolError
from kvplane.kvevents.schema import Encoding, Hash, event_types

SEQ_BYTES = 8
END_OF_REPLAY = -1
LOW64 = (1 << 64) - 1

WRITE = {"map": event_types("map", reading=False), "array": event_types("array", reading=False)}
_READ_MAP = event_types("map", reading=True)
_READ_ARR = event_types("array", reading=True)


# -- decoded forms ----------------------------------------------------------------------------
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


# -- encoding ---------------------------------------------------------------------------------
_ENC = msgspec.msgpack.Encoder()


def stored(hashes: Sequence[Hash], tokens: Sequence[int], block_size: int, *,
           parent: Hash | None = None, medium: str | None = "GPU", lora_name: str | None = None,
           extra_keys: list[tuple[object, ...] | None] | None = None,
           encoding: Encoding = "map") -> msgspec.Struct:
    """Build a ``BlockStored`` event as vLLM writes it in ``encoding``."""
    if encoding == "array":  # as vLLM wrote it before the map switch: group and spec left nil
        return WRITE["array"].stored(list(hashes), parent, list(tokens), block_size, None,
                                     medium, lora_name, extra_keys)
    return WRITE["map"].stored(list(hashes), parent, list(tokens), block_size, None, medium,
                               lora_name, extra_keys, 0, "full_attention")


def removed(hashes: Sequence[Hash], *, medium: str | None = "GPU",
            encoding: Encoding = "map") -> msgspec.Struct:
    """Build a ``BlockRemoved`` event as vLLM writes it in ``encoding``."""
    if encoding == "array":
        return WRITE["array"].removed(list(hashes), medium)
    return WRITE["map"].removed(list(hashes), medium, 0)


def cleared(encoding: Encoding = "map") -> msgspec.Struct:
    """Build an ``AllBlocksCleared`` event in ``encoding``."""
    return WRITE[encoding].cleared()


def encode_batch(events: Sequence[msgspec.Struct], dp_rank: int | None = 0,
                 ts: float = 0.0) -> bytes:
    """msgpack-encode a batch exactly as vLLM's publisher does (the batch is an array in both
    encodings; each event keeps the encoding it was built in). ``ts`` is its wall time."""
    batch = WRITE["map"].batch(ts, list(events), dp_rank)
    return _ENC.encode(batch)


def encode_seq(seq: int) -> bytes:
    """The 8-byte big-endian sequence frame (signed, so ``END_OF_REPLAY`` encodes)."""
    return seq.to_bytes(SEQ_BYTES, "big", signed=True)


# -- decoding ---------------------------------------------------------------------------------
class _RawArrBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _RawMapBatch(msgspec.Struct, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_DEC_MAPS = msgspec.msgpack.Decoder(_READ_MAP.batch)
_DEC_ARRS = msgspec.msgpack.Decoder(_READ_ARR.batch)
_DEC_ARR_RAW = msgspec.msgpack.Decoder(_RawArrBatch)
_DEC_MAP_RAW = msgspec.msgpack.Decoder(_RawMapBatch)
_EV_MAP = Union[_READ_MAP.stored, _READ_MAP.removed, _READ_MAP.cleared]  # type: ignore[name-defined]  # classes built at run time
_EV_ARR = Union[_READ_ARR.stored, _READ_ARR.removed, _READ_ARR.cleared]  # type: ignore[name-defined]  # classes built at run time
_DEC_EV_MAP = msgspec.msgpack.Decoder(_EV_MAP)
_DEC_EV_ARR = msgspec.msgpack.Decoder(_EV_ARR)
_DEC_TOKENS = msgspec.msgpack.Decoder(list[int])
_DEC_ANY = msgspec.msgpack.Decoder()
_STORED: tuple[Any, ...] = (_READ_MAP.stored, _READ_ARR.stored)  # classes built at run time
_REMOVED: tuple[Any, ...] = (_READ_MAP.removed, _READ_ARR.removed)


def to_event_hash(value: int | bytes) -> int:
    """Normalise a hash as it arrives in an event (u64, signed i64 or raw digest bytes).

    A digest projects to its last 8 bytes, big-endian, as vLLM does.
    """
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(bytes(value)[-8:], "big")
    return value & LOW64


def _hashes(values: list[Hash]) -> list[int]:
    return [v & LOW64 if isinstance(v, int) else to_event_hash(v) for v in values]


def _convert(ev: Any) -> Event:  # a struct class built at run time (schema.py)
    if isinstance(ev, _STORED):
        parent = None if ev.parent_block_hash is None else to_event_hash(ev.parent_block_hash)
        return BlockStored(_hashes(ev.block_hashes), parent, ev.medium, ev.block_size,
                           ev.lora_name, ev.group_idx, bytes(ev.token_ids), bytes(ev.extra_keys))
    if isinstance(ev, _REMOVED):
        return BlockRemoved(_hashes(ev.block_hashes), ev.medium, ev.group_idx)
    return AllBlocksCleared()


def _is_map(first: bytes) -> bool:
    return bool(first) and (0x80 <= first[0] <= 0x8F or first[0] in (0xDE, 0xDF))


def _decode_mixed(payload: bytes) -> tuple[float, list[msgspec.Struct], int | None]:
    raw = (_DEC_MAP_RAW if _is_map(payload[:1]) else _DEC_ARR_RAW).decode(payload)
    events = [(_DEC_EV_MAP if _is_map(bytes(item)[:1]) else _DEC_EV_ARR).decode(item)
              for item in raw.events]
    return raw.ts, events, raw.data_parallel_rank


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one msgpack batch in either encoding (per batch and per event).

    Raises:
        ProtocolError: when the payload is not a valid batch in any known encoding.
    """
    batch: Any = None  # a batch struct of one of the decoders (classes built at run time)
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
