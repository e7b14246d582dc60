"""Wire framing of the collectives data plane: one fixed header in front of every message.

Pure: no sockets, no clocks, no torch. The header carries the membership epoch, the op
sequence number and the participant mask of the attempt, so a receiver can drop traffic of an
older view and learn from a peer's mask that it has excluded someone.

Layout (little endian, 40 bytes)::

    magic u32 | kind u8 | flags u8 | src u16 | epoch u32 | seq u32 | mask u64 | step u32 | tag i32
    | nbytes u64
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvplane.common.errors import ProtocolError

MAGIC = 0x4C50564B  # "KVPL" little endian
MAX_SLOTS = 64  # the participant mask is one u64

KIND_DATA = 1  # a collective's payload for (seq, mask, step)
KIND_ABORT = 2  # "attempt (seq) restarts with participants = mask"; no payload
KIND_P2P = 3  # send/recv payload; seq is the per-pair counter, tag the user tag
KIND_HELLO = 4  # first frame on a new connection; src, epoch and tag=incarnation
_KINDS = (KIND_DATA, KIND_ABORT, KIND_P2P, KIND_HELLO)

_HDR = struct.Struct("<IBBHIIQIiQ")
HEADER_SIZE = _HDR.size


@dataclass(frozen=True, slots=True)
class Header:
    """One frame header.

    Attributes:
        kind: one of the ``KIND_*`` constants.
        src: the sender's rank (slot).
        epoch: the sender's membership epoch.
        seq: collective sequence number in the epoch (per-pair counter for P2P).
        mask: participant bitmask of the sender's attempt.
        step: algorithm step the payload belongs to.
        tag: user tag (P2P) or incarnation (HELLO).
        nbytes: payload length that follows the header.
    """

    kind: int
    src: int
    epoch: int
    seq: int
    mask: int
    step: int
    tag: int
    nbytes: int

    def pack(self) -> bytes:
        """Encode the header (40 bytes)."""
        return _HDR.pack(MAGIC, self.kind, 0, self.src, self.epoch, self.seq, self.mask,
                         self.step, self.tag, self.nbytes)

    @classmethod
    def unpack(cls, buf: bytes | bytearray | memoryview, max_payload: int) -> Header:
        """Decode and validate a header.

        Args:
            buf: exactly :data:`HEADER_SIZE` bytes.
            max_payload: the largest ``nbytes`` accepted.

        Raises:
            ProtocolError: on a bad magic, an unknown kind or an oversized payload.
        """
        magic, kind, _flags, src, epoch, seq, mask, step, tag, nbytes = _HDR.unpack(buf)
        if magic != MAGIC:
            raise ProtocolError(f"bad frame magic {magic:#x}")
        if kind not in _KINDS:
            raise ProtocolError(f"unknown frame kind {kind}")
        if nbytes > max_payload:
            raise ProtocolError(f"frame of {nbytes} bytes exceeds the limit of {max_payload}")
        if kind == KIND_ABORT and nbytes:
            raise ProtocolError("abort frames carry no payload")
        return cls(kind, src, epoch, seq, mask, step, tag, nbytes)


def bits(ranks: list[int] | set[int] | range) -> int:
    """The bitmask of a set of ranks."""
    m = 0
    for r in ranks:
        if not 0 <= r < MAX_SLOTS:
            raise ValueError(f"rank {r} outside 0..{MAX_SLOTS - 1}")
        m |= 1 << r
    return m


def ranks_of(mask: int) -> list[int]:
    """The ranks set in ``mask``, ascending."""
    out = []
    r = 0
    while mask:
        if mask & 1:
            out.append(r)
        mask >>= 1
        r += 1
    return out
