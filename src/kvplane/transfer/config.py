"""EngineConfig: every knob of a TransferEngine, one frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvplane.common import envs
from kvplane.common.auth import client_token
from kvplane.common.errors import InvalidArgument
from kvplane.transfer import fabric
from kvplane.transfer.fabric import FabricChoice

PROTOCOLS = ("auto", "tcp", "shm", "file", "nixl", "rdma")


@dataclass(frozen=True)
class EngineConfig:
    """Transfer engine configuration.

    Attributes:
        host: address the data listener binds and advertises (127.0.0.1 unless told otherwise).
        port: data/handshake port; 0 picks a free one.
        name: segment name; default ``host:port`` (Mooncake's P2PHANDSHAKE naming).
        metadata: ``P2PHANDSHAKE``, ``memory://NAME``, ``http://h:p/metadata``, ``etcd://h:p``
            or ``redis://h:p``.
        protocol: what was asked for: ``auto`` (shm/file on the same host, then nixl when
            installed, else tcp), ``rdma`` (or another Mooncake hardware name: nixl when
            installed, else tcp with one warning), ``nixl`` or one transport name; read through
            :mod:`kvplane.transfer.fabric` at construction, and ``fabric`` says what it became.
        token: token this engine presents to peers and its listener requires (empty: none;
            default ``KVPLANE_TOKEN``, else the token file).
        extra_tokens: more tokens the listener accepts (e.g. a pool's tenant tokens).
        grants: connections that authenticate with one of ``extra_tokens`` move bytes only
            under grants (``kvplane.transfer.grants``; a store segment serving tenants sets it).
        timeout: default per-transfer timeout, seconds.
        connect_timeout: longest a new connection and its HELLO may take, seconds (capped by
            the transfer's deadline; a stalled peer is found within it, then retried).
        slice_size: largest piece one TCP frame carries.
        streams: TCP connections a large batch is striped over.
        max_frame: largest frame the listener accepts.
        max_connections: most inbound data connections.
        file_root: directory file-backed segments must live in ("" disables file segments).
        republish_interval: seconds between checks that our descriptor is still published.
        retries: times a slice is retried on a fresh connection after its connection broke.
        device_chunk: bytes per chunk when device memory moves through host staging (each
            chunk passes through one staging slot; see ``kvplane.transfer.staging``).
        device_slots: host staging slots (of ``device_chunk`` bytes, pinned for CUDA)
            allocated once per device on its first staged move; one transfer uses two at
            most (one copying while the other moves).
        transports: transports this engine loads (the defaults gain "nixl" when ``fabric``
            chose it).
        fabric: the resolved choice (set at construction; ``protocol``/``transports`` above
            are the resolved ones).
    """

    host: str = "127.0.0.1"
    port: int = 0
    name: str | None = None
    metadata: str = "P2PHANDSHAKE"
    protocol: str = "auto"
    token: str = field(default_factory=client_token)
    extra_tokens: tuple[str, ...] = ()
    grants: bool = False
    timeout: float = 30.0
    connect_timeout: float = 5.0
    slice_size: int = 4 << 20
    streams: int = 2
    max_frame: int = 256 << 20
    max_connections: int = 512
    file_root: str = ""
    republish_interval: float = 2.0
    retries: int = 2
    device_chunk: int = 4 << 20
    device_slots: int = 4
    transports: tuple[str, ...] = field(default=fabric.DEFAULT_TRANSPORTS)
    fabric: FabricChoice = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        choice = fabric.resolve(self.protocol, tuple(self.transports))  # InvalidArgument
        object.__setattr__(self, "protocol", choice.protocol)
        object.__setattr__(self, "transports", choice.transports)
        object.__setattr__(self, "fabric", choice)
        if self.slice_size <= 0 or self.slice_size > self.max_frame:
            raise InvalidArgument("slice_size must be in (0, max_frame]")
        if not 0 < self.device_chunk <= self.max_frame or self.device_slots < 1:
            raise InvalidArgument("device_chunk must be in (0, max_frame] and device_slots >= 1")
        if self.streams < 1 or self.timeout <= 0 or self.connect_timeout <= 0:
            raise InvalidArgument("streams must be >= 1, timeout and connect_timeout > 0")

    @classmethod
    def from_env(cls, **overrides: Any) -> EngineConfig:
        """Defaults, then KVPLANE_* environment, then explicit ``overrides`` (which win)."""
        fields: dict[str, Any] = dict(
            timeout=envs.get("KVPLANE_TRANSFER_TIMEOUT"),
            connect_timeout=envs.get("KVPLANE_CONNECT_TIMEOUT"),
            slice_size=envs.get("KVPLANE_SLICE_SIZE"),
            streams=envs.get("KVPLANE_TCP_STREAMS"),
            max_frame=envs.get("KVPLANE_MAX_FRAME"),
            max_connections=envs.get("KVPLANE_MAX_CONNECTIONS"),
            file_root=envs.get("KVPLANE_FILE_ROOT"),
            transports=envs.get("KVPLANE_TRANSPORTS"),
        )
        # one resolution, of the protocol asked for: resolving the default ``auto`` first
        # added "nixl" to the transports, which an explicit ``tcp`` then kept
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)
