"""The eviction policy: how much to free, which objects may go, and what a verdict means.

Pure (no I/O, no clock: ``now`` comes from the caller). ``ObjectTable.evict``
(``kvplane.store.master.table``) walks its objects oldest first and asks this module whether
each one is a candidate; the disk tier (``tiers.py``) answers with a :class:`Verdict` how a
candidate leaves memory. Imports only the master's config: it sits below the object table.
"""

from __future__ import annotations

import enum
from typing import Protocol

from kvplane.store.master.config import MasterConfig


class Verdict(enum.Enum):
    """How eviction treats one candidate (the disk tier decides, ``DiskTier.verdict``)."""

    DROP = "drop"  # no disk tier for it: forget the object
    DEMOTE = "demote"  # it has a disk copy: drop its memory replicas, stay readable from disk
    KEEP = "keep"  # its disk copy is being made (or will be): evictable once it is


class Candidate(Protocol):
    """The fields of an object the policy reads (``table.Obj`` has them)."""

    @property
    def complete(self) -> bool: ...
    @property
    def hard_pin(self) -> bool: ...
    @property
    def lease_until(self) -> float: ...
    @property
    def soft_pin_until(self) -> float: ...
    @property
    def replicas(self) -> tuple[object, ...]: ...


def target_bytes(config: MasterConfig, used: int, held: int, cap: int, need: int) -> float:
    """Bytes one pass should free: down past the high watermark by ``evict_ratio``, or
    ``need`` (room for a put), whichever is more; 0 when nothing must go.

    Args:
        config: the watermark and ratio.
        used: bytes allocated over every segment.
        held: bytes in quarantine for readers of removed objects: they free themselves when
            the leases end and must not push live objects out.
        cap: bytes of every segment together (> 0).
        need: bytes a put is waiting for (0: a timer pass).
    """
    over = used - held - config.high_watermark * cap
    return max(need, over + config.evict_ratio * cap if over > 0 else 0)


def evictable(obj: Candidate, now: float, soft_pass: bool) -> bool:
    """Whether ``obj`` may go in this pass: never leased, unfinished, hard-pinned or
    memory-less objects; soft-pinned ones only in the second pass (``soft_pass``)."""
    if not obj.complete or obj.hard_pin or obj.lease_until > now:
        return False
    return (obj.soft_pin_until > now) == soft_pass and bool(obj.replicas)
