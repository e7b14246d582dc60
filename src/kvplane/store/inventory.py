"""The segments' inventory: a record header in front of every object, and the scan that reads
them back (issue 10, "no metadata loss").

Every allocation the master hands out is ``[header][value]``. The master builds the header
(key, version, size, checksum, flags, wanted replicas, and a keyed tag over all of them) and the
writer copies it into each replica together with the value. A segment therefore holds, in its
own memory, the authoritative inventory of the objects it stores; when it mounts with a master
that does not know it (a new leader, a restarted master) it scans its memory and re-registers
every record whose value still matches its checksum (``scan``). The master re-stamps each record
it accepts with a generation of its own epoch (``restamp``) and frees the rest (``invalidate``).

Why a record is trusted only when its value verifies: headers and values travel as separate
slices, in any order, and a freed allocation's space may be reused while its old header is still
there. The checksum decides: a record whose bytes still hash to its checksum describes exactly
the bytes in memory, whatever was written around it. Records that overlap are resolved newest
first (the segment's own mount history orders epochs, see ``Ordering``).

The tag is a keyed BLAKE2b over the header fields and the key, keyed by the service token: a
client holding only a tenant token cannot forge a record that names another tenant's key.

Pure: numpy and hashing only, no I/O, no clocks. Imports ``kvplane.store.checksum`` and the
fence's generation layout.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec
import numpy as np

from kvplane.store.checksum import digest
from kvplane.transfer.fence import COUNTER_MASK, epoch_of

MAGIC = b"KVPLREC1"
MAGIC_U64 = int.from_bytes(MAGIC, "little")
ALIGN = 64
_HEAD = struct.Struct("<8sIHHQQQQHH4x16s")  # magic len klen flags gen version size csum want 0 tag
_TAGGED = struct.Struct("<IHHQQQH")  # the fields the tag covers (not the magic, not the gen)
FIXED = _HEAD.size  # 72: the key follows
MAX_HEADER = 1 << 16
FLAG_HARD_PIN = 1
SCAN_CHUNK = 64 << 20  # bytes of memory looked at per step of the scan (bounds its temporaries)


def header_len(key: bytes | str) -> int:
    """Bytes of the header of an object under ``key`` (a multiple of ``ALIGN``)."""
    n = len(key.encode() if isinstance(key, str) else key)
    return (FIXED + n + ALIGN - 1) // ALIGN * ALIGN


def secret_of(token: str) -> bytes:
    """The tag key derived from the service token (empty token: an unkeyed hash)."""
    if not token:
        return b""
    return hashlib.blake2b(token.encode(), digest_size=32, person=b"kvplane-inv").digest()


@functools.lru_cache(maxsize=16)
def _keyed(secret: bytes) -> hashlib.blake2b:
    """A blake2b keyed with ``secret``, to copy: the key block is hashed once, not per tag."""
    return hashlib.blake2b(digest_size=16, key=secret)


def _tag(secret: bytes, hlen: int, key: bytes, flags: int, version: int, size: int,
         checksum: int, want: int) -> bytes:
    h = _keyed(secret).copy()
    h.update(_TAGGED.pack(hlen, len(key), flags, version, size, checksum, want))
    h.update(key)
    return h.digest()


def pack(secret: bytes, key: str, gen: int, version: int, size: int, checksum: int,
         want: int = 1, flags: int = 0, hlen: int = 0) -> bytes:
    """The header of one object (the same for every replica of a put: they share ``gen``).
    ``hlen``: ``header_len(key)`` when the caller has it already (0: computed here)."""
    kb = key.encode()
    hlen = hlen or header_len(kb)
    tag = _tag(secret, hlen, kb, flags, version, size, checksum, want)
    head = _HEAD.pack(MAGIC, hlen, len(kb), flags, gen, version, size, checksum, want, 0, tag)
    return head + kb + bytes(hlen - FIXED - len(kb))


class Record(msgspec.Struct, array_like=True):
    """One object a segment holds, as it re-registers it with a master.

    ``offset`` is the allocation's start inside the segment (the header; the value follows
    ``hdr`` bytes later).
    """

    offset: int
    hdr: int
    key: str
    version: int
    gen: int
    size: int
    checksum: int
    want: int = 1
    flags: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.hdr + self.size


def parse(mem: np.ndarray, off: int, secret: bytes) -> Record | None:
    """The record whose header starts at ``off`` in ``mem`` if it is well formed and its tag is
    valid (its value is not checked here), else None."""
    if off + FIXED > len(mem):
        return None
    (magic, hlen, klen, flags, gen, version, size, csum, want, _, tag) = _HEAD.unpack_from(mem.data, off)
    if magic != MAGIC or hlen % ALIGN or not FIXED + klen <= hlen <= MAX_HEADER or klen == 0:
        return None
    if off + hlen + size > len(mem) or size <= 0:
        return None
    kb = bytes(mem[off + FIXED:off + FIXED + klen])
    if _tag(secret, hlen, kb, flags, version, size, csum, want) != tag:
        return None
    try:
        key = kb.decode()
    except UnicodeDecodeError:
        return None
    return Record(off, hlen, key, version, gen, size, csum, want, flags)


def intact(mem: np.ndarray, rec: Record) -> bool:
    """True when the record's value still hashes to its checksum."""
    start = rec.offset + rec.hdr
    return digest(mem[start:start + rec.size].data) == rec.checksum


class Ordering:
    """Orders generations newest first by one segment's mount history.

    Epochs are random for a lone master (nothing persists across its restarts), so their
    numbers say nothing about age; the segment knows in which order it mounted with them.
    Generations of an epoch it never mounted with count as oldest.
    """

    def __init__(self, history: Iterable[int]) -> None:
        self._rank = {e: i for i, e in enumerate(history)}

    def key(self, gen: int) -> tuple[int, int]:
        return self._rank.get(epoch_of(gen), -1), gen & COUNTER_MASK


def candidates(mem: np.ndarray) -> list[int]:
    """Offsets (multiples of ``ALIGN``) where a header's magic sits."""
    usable = len(mem) - len(mem) % ALIGN
    out: list[int] = []
    for start in range(0, usable, SCAN_CHUNK):
        block = mem[start:min(usable, start + SCAN_CHUNK)]
        words = block.view(np.uint64)[::ALIGN // 8]
        out.extend(int(i) * ALIGN + start for i in np.flatnonzero(words == MAGIC_U64))
    return out


@dataclass
class ScanResult:
    """What a scan found: records to re-register, and header offsets to invalidate."""

    records: list[Record]
    stale: list[int]  # headers of broken, unverified or overlapped records


def scan(mem: np.ndarray, secret: bytes, history: Iterable[int]) -> ScanResult:
    """Every intact record in ``mem`` (a segment's memory, allocation offsets from 0).

    Overlapping intact records (a freed allocation whose space was reused before its header
    was invalidated) keep the newest only, by ``Ordering``.
    """
    order = Ordering(history)
    found, stale = [], []
    for off in candidates(mem):
        rec = parse(mem, off, secret)
        if rec is None or not intact(mem, rec):
            stale.append(off)
        else:
            found.append(rec)
    kept: list[Record] = []
    taken: list[tuple[int, int]] = []  # accepted (start, end), kept sorted
    for rec in sorted(found, key=lambda r: order.key(r.gen), reverse=True):
        if _overlaps(taken, rec.offset, rec.end):
            stale.append(rec.offset)
            continue
        bisect.insort(taken, (rec.offset, rec.end))
        kept.append(rec)
    kept.sort(key=lambda r: r.offset)
    return ScanResult(kept, stale)


def _overlaps(taken: list[tuple[int, int]], start: int, end: int) -> bool:
    i = bisect.bisect_left(taken, (start, start))
    if i < len(taken) and taken[i][0] < end:
        return True
    return i > 0 and taken[i - 1][1] > start


def restamp(mem: np.ndarray, off: int, gen: int) -> None:
    """Write generation ``gen`` into the header at ``off`` (after a master accepted it)."""
    struct.pack_into("<Q", mem.data, off + 16, gen)


def invalidate(mem: np.ndarray, off: int, gen: int | None = None) -> bool:
    """Clear the magic of the header at ``off`` (only if it still carries ``gen``, when given).

    Returns True when a header was cleared.
    """
    if off < 0 or off + FIXED > len(mem):
        return False
    magic, = struct.unpack_from("<8s", mem.data, off)
    if magic != MAGIC:
        return False
    if gen is not None and struct.unpack_from("<Q", mem.data, off + 16)[0] != gen:
        return False
    mem[off:off + 8] = 0
    return True
