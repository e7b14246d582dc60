"""Plain types of the transfer engine: opcodes, statuses, requests, and wire descriptors.

Imports nothing from the rest of ``kvplane.transfer``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import msgspec


class OpCode(enum.IntEnum):
    """Direction of a request, seen from the initiator (Mooncake: READ=0, WRITE=1)."""

    READ = 0  # remote -> local source buffer
    WRITE = 1  # local source buffer -> remote


class TransferStatus(enum.IntEnum):
    """Per-request status (Mooncake TransferStatusEnum order)."""

    WAITING = 0
    PENDING = 1
    INVALID = 2
    CANCELED = 3
    COMPLETED = 4
    TIMEOUT = 5
    FAILED = 6

    @property
    def done(self) -> bool:
        """True for terminal states."""
        return self not in (TransferStatus.WAITING, TransferStatus.PENDING)


class RegionKind(enum.StrEnum):
    """What backs a registered region (a ``str``: descriptors carry the plain value)."""

    MEM = "mem"  # process memory: TCP, or same-host cross-memory attach
    SHM = "shm"  # POSIX shared memory that same-host peers map
    FILE = "file"  # a file under the owner's file root (offsets map onto the file)
    DEVICE = "dev"  # accelerator memory (``device`` names it): not addressable by the host


class TaskStatus(NamedTuple):
    """Where one request of a batch stands (``TransferEngine.status``)."""

    status: TransferStatus
    transferred: int  # bytes moved so far


@dataclass(frozen=True, slots=True)
class TransferRequest:
    """One move between local registered memory and a remote segment.

    Attributes:
        op: READ copies remote -> ``source``; WRITE copies ``source`` -> remote.
        source: local address inside a registered region.
        target: segment handle returned by ``TransferEngine.open_segment``.
        target_offset: remote address (memory regions) inside the target's registered memory.
        length: bytes to move.
        transport: ``None``/"auto" picks per target; "tcp", "shm" or "file" forces one.
        gen: the store allocation's generation, checked by the target's listener (0: none; see
            ``kvplane.transfer.fence``). Same-host copies with a generation are also checked
            against the deadline after the copy.
    """

    op: OpCode
    source: int
    target: int
    target_offset: int
    length: int
    transport: str | None = None
    gen: int = 0


class RegionDesc(msgspec.Struct, frozen=True):
    """A registered region as published to peers.

    ``kind`` is "mem" (reachable over TCP or same-host CMA), "shm" (POSIX shared memory
    ``shm`` that same-host peers map) or "file" (a file ``path`` under the owner's file root;
    ``addr`` is then a synthetic base address and offsets map onto the file). ``file_id``
    (``"dev:inode"``) names the owner's file itself, so a same-host peer opens it only when
    its own file of that name is the very same file. A ``fenced`` shm region publishes its
    owner's fence floor in its first 8 bytes: same-host writers check a store generation
    against it, as the owner's listener does for TCP frames. A "dev" region is accelerator
    memory on ``device`` (no host view: bytes go through the device's copy engine or a
    transport that reads device memory itself, such as NIXL with VRAM).
    """

    addr: int
    length: int
    kind: str = RegionKind.MEM  # a RegionKind value (plain str on the wire)
    shm: str = ""
    path: str = ""
    file_id: str = ""
    fenced: bool = False  # its first 8 bytes hold the fence floor (``kvplane.transfer.fence``)
    device: str = ""  # "" host memory; else the device holding it ("cuda:0", "standin:0")


class SegmentDesc(msgspec.Struct, frozen=True):
    """A segment descriptor: everything a peer needs to reach one engine's memory."""

    name: str
    host: str
    port: int
    host_id: str
    pid: int
    transports: list[str]
    regions: list[RegionDesc]
    version: int = 0
    # per transport name, what a one-sided fabric's peers need (e.g. NIXL agent metadata)
    adverts: dict[str, bytes] = msgspec.field(default_factory=dict)
