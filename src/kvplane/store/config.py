"""StoreConfig: how a client reaches the master and what it contributes."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from kvplane.common import envs
from kvplane.common.auth import client_token
from kvplane.common.errors import InvalidArgument


@dataclass(frozen=True)
class StoreConfig:
    """Store client configuration (Mooncake's setup() arguments, plus timeouts).

    Attributes:
        master: master RPC address ``host:port``.
        metadata: transfer-engine metadata: ``P2PHANDSHAKE`` or a backend URL.
        local_hostname: address this client's engine binds and advertises.
        port: port the engine binds (0: any free one); the segment is named ``host:port``.
        protocol: ``auto`` (shared memory on one host, then NIXL when installed, else TCP),
            ``tcp`` (TCP even on one host), ``nixl``, or ``rdma`` (NIXL when installed, else TCP
            with one warning); resolved by ``kvplane.transfer.fabric``.
        global_segment_size: bytes this client contributes to the pool (0: pure client).
        local_buffer_size: registered staging for the bytes API (put/get of ``bytes``).
        populate: fault the contributed segment's pages in at start (a put never pays the
            first touch); False maps them on first use.
        token: token for the master and the data listeners (default: ``KVPLANE_TOKEN``, else
            the token file; see ``kvplane.common.auth``).
        peer_tokens: more tokens this client's data listener accepts (the tenant tokens, on a
            process that contributes a segment to a pool with tenants).
        timeout: seconds for one whole call (master RPCs, every replica attempt, PutEnd): the
            call's deadline. Keep it well below the master's lease (default 5 s against 10 s),
            so a read that fails over still ends inside its lease.
        heartbeat_interval: seconds between pings (Mooncake 1 s).
        lease_ttl: read lease assumed when the master does not say (masters say: the client
            always uses the master's own TTL).
        checksum: compute an xxh3-64 checksum of every put and check it on every get; a
            mismatch fails over to another replica and is never returned as a success. Off by
            default: it cost more than 10 % on 1 MiB gets (docs/benchmarks.md, "Checksums").
        location_cache: keys whose replica this client remembers (from its gets and its own
            puts), so that a get of such a key reads it while the master looks it up: one round
            trip of wall time instead of two. The bytes count only if the master's answer names
            the same allocation (segment, address, generation); else the key is read again.
            0 turns it off (``KVPLANE_STORE_LOCATION_CACHE``).
        held_reads: a get of keys whose places a lookup confirmed less than half a read lease
            ago reads them without asking the master again (one round trip; upserts and forced
            removes retire the old places first: ``store/client/locations.py``). Needs the
            location cache; off with ``KVPLANE_STORE_HELD_READS=0``.
        spares: a put of one object of at most 1 MiB asks the master, with its PutEnd, to
            place the next one now; a following put of the same shape writes there and
            commits with one PutEnd (two round trips instead of three:
            ``store/client/spares.py``). Off with ``KVPLANE_STORE_SPARES=0``.
        client_id: unique id of this client (fresh by default).
        disk_dir: directory of this node's SSD tier ("" : none; needs a segment).
        disk_size: bytes the SSD tier may hold (its quota).
        disk_write_through: copy every committed object to disk (default: copy objects to disk
            as they near eviction, "offload on eviction").
        disk_direct: read disk files with O_DIRECT instead of through the page cache.
    """

    master: str = "127.0.0.1:50051"
    metadata: str = "P2PHANDSHAKE"
    local_hostname: str = "127.0.0.1"
    port: int = 0
    protocol: str = "auto"
    global_segment_size: int = 0
    local_buffer_size: int = 64 << 20
    populate: bool = True
    token: str = field(default_factory=client_token)
    peer_tokens: tuple[str, ...] = ()
    timeout: float = 5.0
    heartbeat_interval: float = 1.0
    lease_ttl: float = 10.0
    checksum: bool = False
    location_cache: int = 65536
    held_reads: bool = True
    spares: bool = True
    client_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    disk_dir: str = ""
    disk_size: int = 0
    disk_write_through: bool = False
    disk_direct: bool = False

    def __post_init__(self) -> None:
        if self.global_segment_size < 0 or self.local_buffer_size < 0:
            raise InvalidArgument("segment and buffer sizes must be >= 0")
        if self.location_cache < 0:
            raise InvalidArgument("location_cache must be >= 0")
        if self.timeout <= 0 or self.heartbeat_interval <= 0:
            raise InvalidArgument("timeout and heartbeat_interval must be > 0")
        if self.disk_dir and (self.disk_size <= 0 or self.global_segment_size <= 0):
            raise InvalidArgument("an SSD tier (disk_dir) needs disk_size > 0 and a segment")

    @classmethod
    def from_env(cls, **overrides: Any) -> StoreConfig:
        """Defaults (the token from KVPLANE_TOKEN or the token file), then
        KVPLANE_STORE_CHECKSUM, KVPLANE_STORE_LOCATION_CACHE, KVPLANE_STORE_HELD_READS and
        KVPLANE_STORE_SPARES, then explicit ``overrides``."""
        base = cls(checksum=envs.get("KVPLANE_STORE_CHECKSUM"),
                   location_cache=envs.get("KVPLANE_STORE_LOCATION_CACHE"),
                   held_reads=envs.get("KVPLANE_STORE_HELD_READS"),
                   spares=envs.get("KVPLANE_STORE_SPARES"))
        return replace(base, **{k: v for k, v in overrides.items() if v is not None})
