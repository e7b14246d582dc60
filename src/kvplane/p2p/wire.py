"""The tracker's HTTP messages (msgspec structs), shared by ``tracker_api`` and ``client``.

Imports only ``kvplane.p2p.manifest``.
"""

from __future__ import annotations

import msgspec

from kvplane.p2p.manifest import Manifest

PREFIX = "/p2p"
MAX_BODY = 64 << 20


class PublishReq(msgspec.Struct, frozen=True):
    manifest: Manifest
    holder: str
    addrs: list[int]


class OpenReq(msgspec.Struct, frozen=True):
    name: str
    reader: str
    version: int = 0


class ClaimReq(msgspec.Struct, frozen=True):
    name: str
    version: int
    reader: str
    want: int = 0
    strategy: str = "rarest"
    wait: float = 0.0
    addrs: list[int] | None = None
    done: list[tuple[int, str]] = msgspec.field(default_factory=list)
    failed: list[tuple[int, str, str]] = msgspec.field(default_factory=list)


class ClaimResp(msgspec.Struct, frozen=True):
    assign: list[tuple[int, str, int]]
    left: int
    unavailable: list[int]


class CloseReq(msgspec.Struct, frozen=True):
    name: str
    version: int
    reader: str


class WithdrawReq(msgspec.Struct, frozen=True):
    name: str
    holder: str
    version: int = 0


class HeartbeatReq(msgspec.Struct, frozen=True):
    holder: str
    holdings: list[tuple[str, int]] = msgspec.field(default_factory=list)
    reading: list[tuple[str, int]] = msgspec.field(default_factory=list)


class HeartbeatResp(msgspec.Struct, frozen=True):
    drop: list[tuple[str, int]]
