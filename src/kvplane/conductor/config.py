"""Conductor configuration: one frozen dataclass, every field documented.

Must not import sockets or the HTTP stack.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvplane.common.errors import InvalidArgument
from kvplane.conductor.hashing import HashProfile

DEFAULT_PORT = 13333  # Mooncake conductor's default HTTP port


@dataclass(frozen=True)
class ConductorConfig:
    """Settings of one conductor process.

    Attributes:
        host: HTTP bind address.
        port: HTTP port (0 picks a free one).
        token: shared token HTTP clients must present (empty disables the check).
        bind: ZMQ SUB endpoints the conductor binds so engines can *connect* their publishers
            (vLLM connects when its endpoint has no ``*``), e.g. ``tcp://127.0.0.1:5557``.
        default_profile: hash profile for registrations that do not name one.
        max_batch_bytes: largest event batch payload accepted; larger ones are counted and skipped.
        max_request_bytes: largest HTTP request body accepted (413 beyond).
        max_query_tokens: most token ids (or hashes x block size) one query may carry.
        max_instances: most registered (instance, DP rank) streams.
        replay_timeout: seconds one replay request may take before the gap counts as unhealed.
        verify_every: after the first 16 root blocks of a stream are checked against its hash
            profile, check one in this many (0 = never check).
    """

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    token: str = ""
    bind: tuple[str, ...] = ()
    default_profile: HashProfile = field(default_factory=HashProfile)
    max_batch_bytes: int = 16 << 20
    max_request_bytes: int = 8 << 20
    max_query_tokens: int = 1 << 21
    max_instances: int = 4096
    replay_timeout: float = 2.0
    verify_every: int = 64

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise InvalidArgument(f"bad port {self.port}")
        for name in ("max_batch_bytes", "max_request_bytes", "max_query_tokens", "max_instances"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"{name} must be > 0")
        if self.replay_timeout <= 0:
            raise InvalidArgument("replay_timeout must be > 0")
        if self.verify_every < 0:
            raise InvalidArgument("verify_every must be >= 0")
        for ep in self.bind:
            if not ep.startswith(("tcp://", "ipc://", "inproc://")):
                raise InvalidArgument(f"bad ZMQ endpoint {ep!r}")
