"""LRU block caches of the simulated instances, mirrored into the prefix index as KV events would.

A prefill instance has a device tier and a DRAM tier, both LRU and write-through (every computed or
fetched block is put in both, as Mooncake writes new KV to CPU memory while the GPU keeps a working
set); the optional shared pool is one more LRU. Each batch of stores and evictions becomes one
``store`` and one ``remove`` call on the index. Pure; must not import the simulator or policies.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvplane.conductor.scheduling.prefix import IndexPrefixes
from kvplane.kvevents import Tier


class LruTier:
    """A capacity-bounded LRU set of block hashes.

    Args:
        capacity: most blocks held; 0 disables the tier.
    """

    __slots__ = ("capacity", "blocks", "evictions")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0

    def __contains__(self, h: int) -> bool:
        return h in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def touch(self, hashes: Sequence[int]) -> tuple[list[int], list[int]]:
        """Insert or refresh ``hashes``, tail first so the chain head ends most recently used.

        Returns:
            (blocks now held that were not before, blocks no longer held), net of the batch.
        """
        if self.capacity <= 0:
            return [], []
        blocks, cap = self.blocks, self.capacity
        fresh: dict[int, None] = {}  # absent before this batch, in insertion order
        evicted_old: set[int] = set()  # present before this batch, evicted during it
        for h in reversed(hashes):
            if h in blocks:
                blocks.move_to_end(h)
                continue
            if h not in evicted_old:
                fresh[h] = None
            blocks[h] = None
            if len(blocks) > cap:
                victim = blocks.popitem(last=False)[0]
                self.evictions += 1
                if victim not in fresh:
                    evicted_old.add(victim)
        new = [h for h in fresh if h in blocks]
        gone = [h for h in evicted_old if h not in blocks]
        return new, gone


class InstanceCache:
    """A prefill instance's GPU and DRAM tiers, published to the index under ``name``.

    Args:
        name: instance id (the index holder).
        gpu_blocks: device cache capacity.
        cpu_blocks: DRAM cache capacity (0 = GPU only).
        prefixes: the index adapter to publish stores and evictions to.
    """

    def __init__(self, name: str, gpu_blocks: int, cpu_blocks: int, prefixes: IndexPrefixes) -> None:
        self.name, self.prefixes = name, prefixes
        self.gpu, self.cpu = LruTier(gpu_blocks), LruTier(cpu_blocks)

    def has(self, h: int) -> bool:
        """True if the block is on either tier."""
        return h in self.gpu or h in self.cpu

    def put(self, hashes: Sequence[int]) -> None:
        """Record that the request's blocks were computed or loaded here (all tiers)."""
        for tier, lru in ((Tier.GPU, self.gpu), (Tier.CPU, self.cpu)):
            new, gone = lru.touch(hashes)
            if new:
                self.prefixes.store(self.name, tier, new)
            if gone:
                self.prefixes.remove(self.name, tier, gone)


class PoolCache:
    """The shared KV pool (the kvplane store) as one LRU, published as a shared DISK holder.

    Args:
        blocks: capacity (0 disables the pool).
        prefixes: the index adapter.
        name: the shared holder's instance id.
    """

    def __init__(self, blocks: int, prefixes: IndexPrefixes, name: str = "pool") -> None:
        self.name, self.prefixes, self.lru = name, prefixes, LruTier(blocks)

    def __contains__(self, h: int) -> bool:
        return h in self.lru

    def put(self, hashes: Sequence[int]) -> None:
        """Write the request's blocks to the pool."""
        new, gone = self.lru.touch(hashes)
        if new:
            self.prefixes.store(self.name, Tier.DISK, new)
        if gone:
            self.prefixes.remove(self.name, Tier.DISK, gone)


def walk(hashes: Sequence[int], local: InstanceCache, source: InstanceCache | None,
         pool: PoolCache | None) -> tuple[int, int, int, int]:
    """Where the prefix of ``hashes`` is, right now (the simulator's ground truth).

    Returns:
        Cumulative prefix lengths in blocks: (device, + own DRAM, + pulled from ``source``,
        + shared pool); each is >= the previous one.
    """
    n, i = len(hashes), 0
    gpu = local.gpu
    while i < n and hashes[i] in gpu:
        i += 1
    g = i
    while i < n and local.has(hashes[i]):
        i += 1
    c = i
    if source is not None:
        while i < n and source.has(hashes[i]):
            i += 1
    r = i
    if pool is not None:
        while i < n and hashes[i] in pool:
            i += 1
    return g, c, r, i
