"""The global prefix index: context -> block hash -> holders (instance, DP rank, tier).

Pure: no sockets, no clocks, no threads, no locks (the caller serialises access). Must not
import ``zmq``, the HTTP stack or any other conductor module (``Tier`` comes from kvevents), but
for the optional C accelerator ``_accel``, which runs the walk's inner loop.

Layout, chosen to stay lean in memory: a context (tenant, model, LoRA, block size, salt) owns a
``dict[int, int]`` from the 64-bit event hash to a bitmask of *holder slots*; a slot is one
(instance, dp_rank, tier) triple, numbered per context. A block held once costs one dict entry
plus its key (~90-100 bytes measured, see docs/conductor.md); mask values are interned so equal
holder sets share one int object. Removing a whole holder (``clear``/``drop_instance``) scans the
context once; those are rare (cache reset, engine restart, unregister).

Query semantics follow Mooncake's conductor: complete blocks only, stop at the first miss. For
each (instance, rank) a cursor walks the chain while that rank holds the block on GPU (its GPU
prefix); the same cursor then continues while the instance (any rank) or a *shared* holder (the
kvplane store) has the block on CPU, then on DISK. So GPU <= CPU <= DISK are cumulative prefix
lengths; ``longest`` is the DISK cursor; instance values are the max over its ranks and ``dp``
gives each rank's GPU prefix.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import islice, repeat

from kvplane.kvevents import Tier

try:  # the optional C accelerator (see _walk); the Python loops below are the fallback
    from kvplane.conductor import _accel as native
except ImportError:  # pragma: no cover - depends on the build
    native = None  # type: ignore[assignment]  # not built: callers test for None

_INTERN_LIMIT = 1 << 16


@dataclass(frozen=True, slots=True)
class ContextKey:
    """The namespace a hash lives in; blocks of different contexts never match.

    Attributes:
        tenant: tenant id (Mooncake's ``tenant_id``; ``"default"``).
        model: served model name.
        lora: LoRA adapter name, ``""`` for the base model.
        block_size: tokens per block.
        salt: operator-level namespace salt (Mooncake's ``additionalsalt``).
    """

    tenant: str = "default"
    model: str = ""
    lora: str = ""
    block_size: int = 16
    salt: str = ""


@dataclass(frozen=True, slots=True)
class Holder:
    """One place a block can live: an instance's DP rank, on one tier."""

    instance: str
    dp_rank: int
    tier: Tier


@dataclass(slots=True)
class Match:
    """Longest matched prefix of one instance, in blocks (cumulative GPU <= CPU <= DISK).

    Attributes:
        longest: the longest prefix reusable from any tier (== ``disk``).
        gpu: longest prefix on one of the instance's DP ranks' device cache.
        cpu: longest prefix reachable by continuing through host-memory tiers.
        disk: longest prefix reachable by continuing through disk tiers.
        dp: per DP rank, its GPU prefix.
    """

    longest: int = 0
    gpu: int = 0
    cpu: int = 0
    disk: int = 0
    dp: dict[int, int] = field(default_factory=dict)


class _Cursor:
    """One (instance, DP rank) walking the chain: where it stopped on each tier, in blocks.

    ``cpu_holders``/``disk_holders`` are the holder slots whose CPU/DISK copies it may use
    (any rank of its instance, plus the shared holders). -1 = still walking that tier.
    """

    __slots__ = ("instance", "rank", "gpu", "cpu", "disk", "cpu_holders", "disk_holders")

    def __init__(self, instance: str, rank: int, cpu_holders: int, disk_holders: int) -> None:
        self.instance, self.rank = instance, rank
        self.gpu = self.cpu = self.disk = -1
        self.cpu_holders, self.disk_holders = cpu_holders, disk_holders


class _Stages:
    """The cursors still walking, by tier. GPU ones are a bitmask of their GPU holder slots, so
    one AND per block checks them all. CPU and DISK ones are grouped by the holder mask they may
    use (usually few distinct masks: the shared pool's, plus each instance's own), so one AND
    per group checks a block.

    A cursor that cannot continue on its tier at a block stops there and tries the same block
    on the next tier: GPU -> CPU -> DISK -> done.
    """

    __slots__ = ("gpu", "cpu", "disk", "by_bit")

    def __init__(self) -> None:
        self.gpu = 0
        self.by_bit: dict[int, _Cursor] = {}
        self.cpu: dict[int, list[_Cursor]] = {}  # cpu_holders -> cursors walking CPU
        self.disk: dict[int, list[_Cursor]] = {}  # disk_holders -> cursors walking DISK

    def running(self) -> bool:
        return bool(self.gpu or self.cpu or self.disk)

    def start_on_cpu(self, cur: _Cursor) -> None:
        self.cpu.setdefault(cur.cpu_holders, []).append(cur)

    def advance(self, position: int, held: int) -> None:
        """Block ``position`` of the chain is held by the slots in ``held``: stop every cursor
        that cannot continue through it."""
        leaving = self.gpu & ~held
        if leaving:
            self._leave_gpu(position, leaving)
        if self.cpu:
            self._leave_cpu(position, held)
        if self.disk:
            self._leave_disk(position, held)

    def _leave_gpu(self, position: int, leaving: int) -> None:
        self.gpu ^= leaving
        while leaving:
            low = leaving & -leaving
            leaving ^= low
            cur = self.by_bit[low.bit_length() - 1]
            cur.gpu = position
            self.start_on_cpu(cur)

    def _leave_cpu(self, position: int, held: int) -> None:
        for mask in [mask for mask in self.cpu if not held & mask]:
            for cur in self.cpu.pop(mask):
                cur.cpu = position
                self.disk.setdefault(cur.disk_holders, []).append(cur)

    def _leave_disk(self, position: int, held: int) -> None:
        for mask in [mask for mask in self.disk if not held & mask]:
            for cur in self.disk.pop(mask):
                cur.disk = position


class _Context:
    """One context's blocks and holder slots."""

    __slots__ = ("blocks", "slots", "holders", "counts", "free")

    def __init__(self) -> None:
        self.blocks: dict[int, int] = {}
        self.slots: dict[Holder, int] = {}
        self.holders: list[Holder | None] = []
        self.counts: list[int] = []
        self.free: list[int] = []

    def slot(self, holder: Holder) -> int:
        """The bit of ``holder``, allocating (or reusing a freed) one on first use."""
        bit = self.slots.get(holder)
        if bit is None:
            bit = self.free.pop() if self.free else len(self.holders)
            if bit == len(self.holders):
                self.holders.append(holder)
                self.counts.append(0)
            else:
                self.holders[bit] = holder
            self.slots[holder] = bit
        return bit


class PrefixIndex:
    """Block hash -> holders, per context. Not thread-safe: callers hold one lock around it."""

    def __init__(self) -> None:
        self._ctx: dict[ContextKey, _Context] = {}
        self._intern: dict[int, int] = {}

    def _m(self, mask: int) -> int:
        got = self._intern.get(mask)
        if got is None:
            if len(self._intern) >= _INTERN_LIMIT:
                self._intern.clear()
            self._intern[mask] = got = mask
        return got

    def store(self, ctx: ContextKey, holder: Holder, hashes: Iterable[int]) -> int:
        """Record that ``holder`` has every block in ``hashes``.

        Returns:
            How many (block, holder) entries were new.
        """
        c = self._ctx.get(ctx)
        if c is None:
            c = self._ctx[ctx] = _Context()
        bit = c.slot(holder)
        b = 1 << bit
        blocks, new = c.blocks, 0
        for h in hashes:
            m = blocks.get(h, 0)
            if not m & b:
                blocks[h] = self._m(m | b)
                new += 1
        c.counts[bit] += new
        return new

    def remove(self, ctx: ContextKey, holder: Holder, hashes: Iterable[int]) -> int:
        """Forget ``holder`` for each block in ``hashes`` (unknown ones are ignored).

        Returns:
            How many entries were removed.
        """
        c = self._ctx.get(ctx)
        bit = None if c is None else c.slots.get(holder)
        if c is None or bit is None:
            return 0
        b, blocks, gone = 1 << bit, c.blocks, 0
        for h in hashes:
            m = blocks.get(h, 0)
            if m & b:
                rest = m & ~b
                if rest:
                    blocks[h] = self._m(rest)
                else:
                    del blocks[h]
                gone += 1
        c.counts[bit] -= gone
        return gone

    def clear(self, ctx: ContextKey | None, instance: str, dp_rank: int | None = None,
              tiers: Collection[Tier] | None = None, release: bool = False) -> int:
        """Forget every block an instance holds (optionally one rank, some tiers).

        Args:
            ctx: the context, or None for every context.
            instance: the instance id.
            dp_rank: only this rank (None = all ranks).
            tiers: only these tiers (None = all).
            release: also free the holder slots (use when the instance is unregistered).

        Returns:
            How many entries were removed.
        """
        total = 0
        for key in ([ctx] if ctx is not None else list(self._ctx)):
            c = self._ctx.get(key)
            if c is None:
                continue
            chosen = [h for h in c.slots if h.instance == instance
                      and (dp_rank is None or h.dp_rank == dp_rank)
                      and (tiers is None or h.tier in tiers)]
            total += self._drop_slots(c, chosen, release)
            if not c.slots and not c.blocks:
                del self._ctx[key]
        return total

    def _drop_slots(self, c: _Context, chosen: list[Holder], release: bool) -> int:
        bits = [c.slots[h] for h in chosen]
        mask = sum(1 << b for b in bits)
        removed = sum(c.counts[b] for b in bits)
        if removed:
            keep = ~mask
            for block, m in list(c.blocks.items()):
                if m & mask:
                    rest = m & keep
                    if rest:
                        c.blocks[block] = self._m(rest)
                    else:
                        del c.blocks[block]
        for h, b in zip(chosen, bits):
            c.counts[b] = 0
            if release:
                del c.slots[h]
                c.holders[b] = None
                c.free.append(b)
        return removed

    def drop_instance(self, instance: str) -> int:
        """Forget an instance everywhere and release its slots. Returns entries removed."""
        return self.clear(None, instance, release=True)

    def match(self, ctx: ContextKey, hashes: Iterable[int],
              instances: Mapping[str, Collection[int]] | None = None,
              shared: Collection[str] = ()) -> dict[str, Match]:
        """Longest matched prefix per instance and tier for a chain of block hashes.

        This is the query primitive (also for offline schedulers/simulators): ``hashes`` may be
        a lazy iterator; it is consumed only until every cursor has stopped.

        Args:
            ctx: the context to look in.
            hashes: 64-bit event hashes of consecutive complete blocks, from the root.
            instances: instance id -> its DP ranks to report (None = every non-shared
                instance holding anything in ``ctx``, with the ranks seen).
            shared: instances whose CPU/DISK holdings count for every instance (a shared
                KV pool such as the kvplane store); they are not reported themselves.

        Returns:
            Instance id -> :class:`Match` (in blocks). Instances with no hit get zeros.
        """
        c = self._ctx.get(ctx)
        if instances is None:
            instances = self._instances_of(c, shared)
        if c is None:
            return {i: Match(dp={r: 0 for r in ranks}) for i, ranks in instances.items()}
        cursors, stages = self._cursors(c, instances, shared)
        _walk(c.blocks, hashes, stages)
        return _summarise(cursors, instances)

    def _instances_of(self, c: _Context | None, shared: Collection[str]) -> dict[str, set[int]]:
        out: dict[str, set[int]] = {}
        for h in (c.slots if c is not None else ()):
            if h.instance not in shared:
                out.setdefault(h.instance, set()).add(h.dp_rank)
        return out

    def _cursors(self, c: _Context, instances: Mapping[str, Collection[int]],
                 shared: Collection[str]) -> tuple[list[_Cursor], _Stages]:
        """One cursor per asked (instance, rank), on GPU if that rank has a GPU slot, else
        starting on CPU at block 0."""
        tier_masks: dict[str, list[int]] = {}  # instance -> [gpu, cpu, disk] slot masks
        for h, bit in c.slots.items():
            tier_masks.setdefault(h.instance, [0, 0, 0])[h.tier] |= 1 << bit
        shared_cpu = shared_disk = 0
        for inst in shared:
            tm = tier_masks.get(inst)
            if tm is not None:
                shared_cpu, shared_disk = shared_cpu | tm[Tier.CPU], shared_disk | tm[Tier.DISK]
        cursors: list[_Cursor] = []
        stages = _Stages()
        for inst, ranks in instances.items():
            tm = tier_masks.get(inst, [0, 0, 0])
            cpu, disk = shared_cpu | tm[Tier.CPU], shared_disk | tm[Tier.DISK]
            for r in ranks:
                cur = _Cursor(inst, r, cpu, disk)
                cursors.append(cur)
                slot = c.slots.get(Holder(inst, r, Tier.GPU))
                if slot is None:
                    cur.gpu = 0
                    stages.start_on_cpu(cur)
                else:
                    stages.by_bit[slot] = cur
                    stages.gpu |= 1 << slot
        return cursors, stages

    def contexts(self) -> list[ContextKey]:
        """Contexts that hold at least one holder slot."""
        return list(self._ctx)

    def holders(self, ctx: ContextKey, block_hash: int) -> list[Holder]:
        """Who holds one block (for inspection and tests)."""
        c = self._ctx.get(ctx)
        m = 0 if c is None else c.blocks.get(block_hash, 0)
        out = []
        while m:
            low = m & -m
            m ^= low
            h = c.holders[low.bit_length() - 1]  # type: ignore[union-attr]  # a set bit has a holder
            if h is not None:
                out.append(h)
        return out

    def held_by(self, ctx: ContextKey, holder: Holder) -> int:
        """How many blocks one holder has in ``ctx``."""
        c = self._ctx.get(ctx)
        bit = None if c is None else c.slots.get(holder)
        return 0 if bit is None else c.counts[bit]  # type: ignore[union-attr]  # bit is set only when c is

    def stats(self) -> dict[str, int]:
        """Sizes: contexts, distinct blocks, (block, holder) entries, holder slots."""
        return {
            "contexts": len(self._ctx),
            "blocks": sum(len(c.blocks) for c in self._ctx.values()),
            "entries": sum(sum(c.counts) for c in self._ctx.values()),
            "holders": sum(len(c.slots) for c in self._ctx.values()),
        }


def _walk(blocks: dict[int, int], hashes: Iterable[int], stages: _Stages) -> None:
    """Advance every cursor block by block until all have stopped (or the chain ends).

    A list, or a stream with ``batches()`` (:meth:`HashProfile.event_hashes`), is walked a list
    at a time: between two blocks where some cursor stops every block is only looked up and
    checked, and the C accelerator finds that run when it is built (:func:`_next_stop`
    otherwise). Any other iterable is pulled one hash at a time (:func:`_walk_each`).
    """
    if not stages.running():
        return
    if isinstance(hashes, list):
        chunks: Iterable[list[int]] = (hashes,)
    elif hasattr(hashes, "batches"):
        chunks = hashes.batches()
    else:
        _walk_each(blocks, hashes, stages)
        return
    run = None if native is None else native.continue_run
    position = 0  # chain index of the chunk's first block
    for chunk in chunks:
        i, n = 0, len(chunk)
        while i < n:
            j = -1 if run is None else run(blocks, chunk, i, stages.gpu, (*stages.cpu, *stages.disk))
            if j < 0:
                j = _next_stop(blocks, chunk, i, stages)
            if j >= n:
                break
            stages.advance(position + j, blocks.get(chunk[j], 0))
            if not stages.running():
                return
            i = j + 1
        position += n
    stages.advance(position, 0)  # past the end of the chain nothing is held


def _walk_each(blocks: dict[int, int], hashes: Iterable[int], stages: _Stages) -> None:
    """:func:`_walk` pulling one hash at a time (a lazy producer stops where the walk does)."""
    gpu, gpu_only = stages.gpu, not (stages.cpu or stages.disk)
    position = -1
    for position, held in enumerate(map(blocks.get, hashes, repeat(0))):
        if gpu_only and gpu & held == gpu:
            continue  # fast path: every running cursor is on GPU and continues
        stages.advance(position, held)
        if not stages.running():
            return
        gpu, gpu_only = stages.gpu, not (stages.cpu or stages.disk)
    stages.advance(position + 1, 0)


def _next_stop(blocks: dict[int, int], chunk: list[int], i: int, stages: _Stages) -> int:
    """The first index from ``i`` where a running cursor cannot continue; ``len(chunk)`` if none."""
    gpu, groups = stages.gpu, (*stages.cpu, *stages.disk)
    for j, held in enumerate(map(blocks.get, islice(chunk, i, None), repeat(0)), i):
        if gpu & held != gpu:
            return j
        for mask in groups:
            if not held & mask:
                return j
    return len(chunk)


def _summarise(cursors: list[_Cursor], instances: Mapping[str, Collection[int]]) -> dict[str, Match]:
    out = {inst: Match() for inst in instances}
    for cur in cursors:
        m = out[cur.instance]
        m.dp[cur.rank] = cur.gpu
        m.gpu, m.cpu, m.disk = max(m.gpu, cur.gpu), max(m.cpu, cur.cpu), max(m.disk, cur.disk)
        m.longest = m.disk
    return out
