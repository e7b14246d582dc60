"""Wire schema helpers: msgspec structs, a versioned envelope, and length-prefixed framing.

Control messages are msgpack-encoded ``msgspec.Struct`` values. Bulk bytes never go through
here; they travel as raw frames of the transfer engine.
"""

from __future__ import annotations

import struct
from typing import Any, TypeVar

import msgspec

from kvplane.common.errors import ProtocolError

WIRE_VERSION = 1
T = TypeVar("T")

_LEN = struct.Struct("!I")
MAX_CONTROL_FRAME = 16 << 20

_encoder = msgspec.msgpack.Encoder()


class Message(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Base class of every control-plane message."""


class Envelope(msgspec.Struct, array_like=True):
    """Request envelope: version, request id, method, token, deadline (ms left), body."""

    v: int
    id: int
    method: str
    token: str
    timeout_ms: int
    body: msgspec.Raw


class Reply(msgspec.Struct, array_like=True):
    """Reply envelope: request id, error code (0 = ok), error message, body."""

    id: int
    code: int
    error: str
    body: msgspec.Raw


def encode(obj: Any) -> bytes:
    """msgpack-encode a struct or plain value."""
    return _encoder.encode(obj)


def decode(data: bytes | memoryview, typ: type[T]) -> T:
    """Decode msgpack into ``typ``.

    Raises:
        ProtocolError: on malformed input or a schema mismatch.
    """
    try:
        return msgspec.msgpack.decode(data, type=typ)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed {getattr(typ, '__name__', typ)}: {exc}") from exc


def frame(payload: bytes) -> bytes:
    """Length-prefix a payload (4-byte big-endian length)."""
    if len(payload) > MAX_CONTROL_FRAME:
        raise ProtocolError(f"frame of {len(payload)} bytes exceeds {MAX_CONTROL_FRAME}")
    return _LEN.pack(len(payload)) + payload


def frame_length(header: bytes, limit: int = MAX_CONTROL_FRAME) -> int:
    """Parse a 4-byte length prefix, enforcing ``limit``."""
    (n,) = _LEN.unpack(header)
    if n > limit:
        raise ProtocolError(f"frame of {n} bytes exceeds limit {limit}")
    return int(n)
