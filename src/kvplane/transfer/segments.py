"""Segment descriptors: this host's identity, descriptor encoding, and opened remote segments."""

from __future__ import annotations

import bisect
import re
import socket
import threading
from dataclasses import dataclass, field

import msgspec

from kvplane.common.errors import AddressNotRegistered, InvalidArgument, ProtocolError
from kvplane.transfer.jobs import Peer
from kvplane.transfer.types import RegionDesc, SegmentDesc

_NAME_RE = re.compile(r"[A-Za-z0-9_.:\-\[\]@/]{1,255}")
_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(SegmentDesc)


def host_identity() -> str:
    """Two processes with the same identity share a kernel (and so /dev/shm and CMA)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown"
    return f"{socket.gethostname()}/{boot}"


def check_name(name: str) -> str:
    """Validate a segment name (no spaces, control characters or over-long names)."""
    if not _NAME_RE.fullmatch(name) or ".." in name:
        raise InvalidArgument(f"bad segment name {name!r}")
    return name


def encode_desc(desc: SegmentDesc) -> bytes:
    """JSON bytes of a descriptor (what metadata backends store)."""
    return _encoder.encode(desc)


def decode_desc(data: bytes) -> SegmentDesc:
    """Parse a descriptor.

    Raises:
        ProtocolError: malformed JSON or schema.
    """
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed segment descriptor: {exc}") from exc


@dataclass
class OpenSegment:
    """A remote (or local) segment as an initiator sees it."""

    handle: int
    name: str
    desc: SegmentDesc
    same_host: bool
    peer: Peer = Peer("", 0)  # the listener's address (set from ``desc``)
    _starts: list[int] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.update(self.desc)

    def update(self, desc: SegmentDesc) -> None:
        """Replace the cached descriptor (after the peer re-registered memory)."""
        regions = sorted(desc.regions, key=lambda r: r.addr)
        with self._lock:
            self.desc = msgspec.structs.replace(desc, regions=regions)
            self._starts = [r.addr for r in regions]
            self.peer = Peer(desc.host, desc.port)

    def region(self, addr: int, length: int) -> RegionDesc:
        """The published region holding [addr, addr+length).

        Raises:
            AddressNotRegistered: the range is outside every published region.
        """
        with self._lock:
            i = bisect.bisect_right(self._starts, addr) - 1
            regions = self.desc.regions
        if i >= 0 and length >= 0 and addr + length <= regions[i].addr + regions[i].length:
            return regions[i]
        raise AddressNotRegistered(
            f"{addr:#x}+{length} is not inside a region published by segment {self.name!r}")
