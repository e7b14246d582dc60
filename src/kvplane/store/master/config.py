"""MasterConfig: every master knob with Mooncake's defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvplane.common.errors import InvalidArgument


@dataclass(frozen=True)
class MasterConfig:
    """Store master configuration.

    Attributes:
        lease_ttl: seconds a read (get/exist) protects an object from remove and eviction.
        client_ttl: seconds without a heartbeat before a client's segments are unmounted.
        high_watermark: used ratio above which eviction starts (Mooncake 0.90).
        evict_ratio: share of capacity one eviction pass frees (Mooncake 0.05).
        put_discard_timeout: seconds after which an unfinished put may be pre-empted.
        put_release_timeout: seconds after which an unfinished put's space is reclaimed.
        soft_pin_ttl: default soft-pin lifetime, seconds (Mooncake 30 min).
        max_soft_pin_ttl: longest soft-pin lifetime a put may ask for, seconds (Mooncake 24 h).
        allow_evict_soft_pinned: soft-pinned objects may go when nothing else can.
        allocation_strategy: "random" or "free_ratio_first".
        max_keys: the master refuses new keys past this many (a memory bound).
        write_window: seconds a put may write its replicas when the client names no deadline;
            space of an unfinished put is not reused before its window is over.
        suspect_min: a segment suspected after a failed transfer is trusted again on a
            heartbeat of its owner at least this many seconds after the suspicion.
        repair_timeout: seconds a re-replication task may take before it is abandoned.
        repairs_per_ping: most re-replication tasks handed to one segment per heartbeat.
        recovery_grace: seconds a master that takes over segments (a new leader, or a restart
            the segments report) answers misses with ``Recovering`` while they re-register
            what they hold; a leader stops earlier once every segment it expects is back.
        offload_watermark: used ratio of a segment with an SSD tier above which its least
            recently used objects are copied to disk ahead of eviction (offload on eviction).
    """

    lease_ttl: float = 10.0
    client_ttl: float = 10.0
    high_watermark: float = 0.90
    evict_ratio: float = 0.05
    put_discard_timeout: float = 30.0
    put_release_timeout: float = 600.0
    soft_pin_ttl: float = 1800.0
    max_soft_pin_ttl: float = 86400.0
    allow_evict_soft_pinned: bool = True
    allocation_strategy: Literal["random", "free_ratio_first"] = "random"
    max_keys: int = 50_000_000
    write_window: float = 10.0
    suspect_min: float = 1.0
    repair_timeout: float = 30.0
    repairs_per_ping: int = 256
    recovery_grace: float = 3.0
    offload_watermark: float = 0.80

    def __post_init__(self) -> None:
        if not 0 < self.high_watermark <= 1 or not 0 < self.evict_ratio <= 1:
            raise InvalidArgument("high_watermark and evict_ratio must be in (0, 1]")
        if self.allocation_strategy not in ("random", "free_ratio_first"):
            raise InvalidArgument("allocation_strategy: random or free_ratio_first")
        if min(self.lease_ttl, self.client_ttl, self.put_discard_timeout) < 0:
            raise InvalidArgument("timeouts must be >= 0")
