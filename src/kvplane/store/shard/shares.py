"""Shares: how a segment's space is divided among the shards of a sharded pool.

Each shard allocates only in its own share of a segment, a contiguous range, so shards never
ask one another for space. ``even`` cuts a segment into equal, aligned shares in shard-id order.
The mount answer of a sharded pool (:class:`ShardedMountRep`) carries, per shard mounted, its
answer and the shares it was given, for the host to fence and re-register each share with the
shard it belongs to (``host.py``).

Pure: no I/O. Imports the store's wire types only.
"""

from __future__ import annotations

import msgspec

from kvplane.store.types import MountRep, SegmentInfo

ALIGN = 4096  # shares start on page boundaries


def even(size: int, ids: list[int]) -> dict[int, tuple[int, int]]:
    """``size`` bytes cut into equal shares, one per shard id in ascending order:
    shard -> (offset, size). The last share takes what rounding leaves."""
    order = sorted(ids)
    n = len(order)
    cuts = [min(size, i * size // n // ALIGN * ALIGN) for i in range(n)] + [size]
    return {sid: (cuts[i], cuts[i + 1] - cuts[i]) for i, sid in enumerate(order)}


class ShardMount(msgspec.Struct):
    """One shard's part of a mount: its answer, the shares it was given, its history (the
    epochs this client mounted with on that shard, the answer's included), ``register``: the
    host re-registers what those shares hold (the shard knew this segment before, or its share
    was just re-cut), after clearing every header in ``clear`` (absolute (address, length)
    ranges that came from another shard's share: nothing there is live any more)."""

    shard: int
    rep: MountRep
    shares: list[SegmentInfo]
    history: list[int]
    register: bool
    clear: list[tuple[int, int]] = msgspec.field(default_factory=list)


class ShardedMountRep(MountRep):
    """A mount answer of a sharded pool: the first shard's answer (epoch, tag key, tenants),
    and every shard's part (``parts``). Built by the client's link, never sent."""

    parts: list[ShardMount] = msgspec.field(default_factory=list)
    dropped: list[int] = msgspec.field(default_factory=list)  # shards that left: close lanes
    # (address, length, epoch): clear the headers there of any other epoch (0: every one)
    clears: list[tuple[int, int, int]] = msgspec.field(default_factory=list)
