"""Quarantine: freed space the master must not hand out again yet. Pure, no I/O, no clock.

Space leaves the quarantine (back to its segment's allocator) only when both hold:

* ``free_after`` has passed: every read lease and write window the master granted on that
  allocation is over, so no client may still start a copy into or out of it;
* the owning segment acknowledged the fence of the allocation's generation, when a write against
  it may still be in flight (an unfinished put that was revoked, pre-empted or abandoned). The
  segment's listener refuses frames of a fenced generation from then on (see
  ``kvplane.transfer.fence``), so a WRITE queued in a stalled segment can never land on reused
  space. A finished put needs no fence: every one of its writes was acknowledged before PutEnd.

Space of a complete object dropped under a read lease (replaced, force-removed, or its replica
dropped) is held for its readers until the lease ends. Its generation is fenced too: a client
may read a place it holds a lease on without asking the master again (the store's held reads),
so the space may be handed out before the lease ends (``release_leased``, when the pool is
full) only once the segment refuses that generation.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Held:
    """One quarantined allocation."""

    segment: str
    offset: int
    size: int
    free_after: float
    gen: int = 0  # nonzero: waiting for the segment to acknowledge fencing this generation
    # held for read leases only: free at ``free_after`` even if the fence is still pending, and
    # earlier when the pool is full once the fence is acknowledged
    readers_only: bool = False


class Quarantine:
    """Quarantined allocations, by (segment, offset)."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, int], Held] = {}
        self._fencing: dict[str, dict[int, tuple[str, int]]] = {}  # segment -> gen -> entry

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, segment: str, offset: int, size: int, free_after: float, gen: int = 0,
             readers_only: bool = False) -> None:
        """Quarantine an allocation until ``free_after`` (and the fence of ``gen``, if set)."""
        self._held[(segment, offset)] = Held(segment, offset, size, free_after, gen, readers_only)
        if gen:
            self._fencing.setdefault(segment, {})[gen] = (segment, offset)

    def to_fence(self, segment: str) -> list[int]:
        """Generations ``segment`` must fence (sent with every heartbeat reply until acked)."""
        return list(self._fencing.get(segment, ()))

    def ack(self, segment: str, gens: list[int]) -> int:
        """``segment`` fenced ``gens``; returns how many pending fences that cleared."""
        pending = self._fencing.get(segment)
        if not pending:
            return 0
        done = 0
        for gen in gens:
            where = pending.pop(gen, None)
            if where is not None and where in self._held:
                self._held[where].gen = 0
                done += 1
        if not pending:
            del self._fencing[segment]
        return done

    def due(self, now: float) -> list[tuple[str, int, int]]:
        """Remove and return the allocations free to reuse at ``now``: (segment, offset,
        size)."""
        out = [k for k, h in self._held.items()
               if (not h.gen or h.readers_only) and h.free_after <= now]
        sizes = []
        for k in out:
            h = self._held.pop(k)
            sizes.append(h.size)
            if h.gen:  # held for readers whose leases are all over: its fence is moot
                self._unfence(h.segment, h.gen)
        return [(seg, off, size) for (seg, off), size in zip(out, sizes, strict=True)]

    def _unfence(self, segment: str, gen: int) -> None:
        pending = self._fencing.get(segment)
        if pending is not None:
            pending.pop(gen, None)
            if not pending:
                del self._fencing[segment]

    def release_leased(self) -> list[tuple[str, int, int]]:
        """Remove and return every entry held only for readers whose segment has fenced its
        generation (never write windows, nor entries whose fence is pending): (segment,
        offset, size)."""
        out = [k for k, h in self._held.items() if h.readers_only and not h.gen]
        return [(seg, off, self._held.pop((seg, off)).size) for seg, off in out]

    def drop_segment(self, segment: str) -> None:
        """Forget everything on an unmounted segment (its memory went with it)."""
        self._held = {k: h for k, h in self._held.items() if h.segment != segment}
        self._fencing.pop(segment, None)

    def held_bytes(self, leased_only: bool = False) -> int:
        """Bytes in quarantine (``leased_only``: those held for readers only)."""
        return sum(h.size for h in self._held.values() if h.readers_only or not leased_only)

    def pending_fences(self) -> int:
        """Fences not yet acknowledged, over every segment."""
        return sum(len(p) for p in self._fencing.values())
