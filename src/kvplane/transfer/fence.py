"""Fence: which allocation generations this engine's data listener still serves.

A store master stamps every allocation with a generation: a u64 with the master's epoch in the
top bits (``EPOCH_SHIFT``) and a counter below, so generations never repeat across master
restarts. READ and WRITE frames carry the generation of the allocation they target (0 means
unfenced: plain transfer-engine use, never checked).

The listener refuses a frame whose generation

* belongs to another master epoch than the one this segment is mounted with (a frame queued
  before a master restart or a leader change), or is older than the ``floor`` the master gave
  at the last mount (a segment that remounts with the same master after its TTL ran out: its
  old allocations are gone from the master), or
* was fenced: the master freed that allocation while a write against it could still be in
  flight (a revoked or abandoned put), and will not reuse the space until this segment has
  acknowledged the fence (see ``install``), or
* was retired: a store client replaced or force-removed the object of that allocation while
  other clients may hold a read lease on it (``retire``; the store's held reads,
  ``kvplane.store.client.get_path``). Retired generations are kept apart from fenced ones, so
  a flood of them never pushes a fence the master waits for out of the table.

``install`` acknowledges only generations with no WRITE in progress, so once the master has the
acknowledgement no byte of a stale frame can land.

Same-host writers copy through shared memory, where no listener mediates: ``attach`` names an
8-byte word in this segment's shared memory where the fence publishes its floor (which carries
the epoch), and the shared-memory transport checks a generation against it before and after each
copy (``admits``). Pure bookkeeping under one lock; imports no sockets and nothing from the store.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict

EPOCH_SHIFT = 40
COUNTER_MASK = (1 << EPOCH_SHIFT) - 1
KEEP = 1 << 20  # fenced generations remembered per epoch (oldest forgotten first)


def epoch_of(gen: int) -> int:
    """The master epoch a generation was issued in."""
    return gen >> EPOCH_SHIFT


def admits(floor: int, gen: int) -> bool:
    """True when a fence at ``floor`` (0: not mounted) admits generation ``gen`` (0: unfenced),
    fenced generations aside: same epoch as the floor, and not below it."""
    return not gen or not floor or floor <= gen < (epoch_of(floor) + 1) << EPOCH_SHIFT


class Fence:
    """The fence table of one data listener. Thread-safe.

    Args:
        keep: how many fenced generations to remember (a bound on memory).
    """

    def __init__(self, keep: int = KEEP) -> None:
        self._lock = threading.Lock()
        self._keep = keep
        self.epoch = 0  # 0: not mounted with a master yet; every epoch is admitted
        self.floor = 0  # lowest generation admitted (its epoch is ``epoch``)
        self._word: memoryview | None = None  # shared-memory copy of the floor
        self._fenced: OrderedDict[int, None] = OrderedDict()
        self._retired: OrderedDict[int, None] = OrderedDict()
        self._writing: Counter[int] = Counter()
        self.refused = 0

    def set_epoch(self, epoch: int, floor: int = 0) -> None:
        """Serve the master of ``epoch`` from now on, generations from ``floor`` up (0: the
        whole epoch); fences of an older epoch are dropped (their frames fail the epoch check
        instead)."""
        floor = max(floor, epoch << EPOCH_SHIFT) if epoch else 0
        with self._lock:
            if epoch != self.epoch:
                self._fenced.clear()
                self._retired.clear()
            self.epoch, self.floor = epoch, floor
            if self._word is not None:
                self._word[:] = floor.to_bytes(8, "little")

    def attach(self, word: memoryview) -> None:
        """Publish the floor into ``word`` (8 bytes of this segment's shared memory)."""
        with self._lock:
            self._word = word
            word[:] = self.floor.to_bytes(8, "little")

    def writing_outside(self) -> int:
        """WRITEs in progress that the current floor would refuse (admitted before a remount)."""
        with self._lock:
            return sum(n for g, n in self._writing.items() if not admits(self.floor, g))

    def _admit(self, gen: int) -> bool:
        ok = admits(self.floor, gen) and gen not in self._fenced and gen not in self._retired
        if not ok:
            self.refused += 1
        return ok

    def admit(self, gen: int) -> bool:
        """True when a READ of generation ``gen`` may be served (0 always may)."""
        if not gen:
            return True
        with self._lock:
            return self._admit(gen)

    def admit_many(self, gens: list[int]) -> list[bool]:
        """:meth:`admit` of each generation, all decided at one instant (one lock)."""
        if not any(gens):
            return [True] * len(gens)
        with self._lock:  # ``_admit`` inlined: a READV asks for up to 256 at once
            floor, fenced, retired = self.floor, self._fenced, self._retired
            if floor:
                top = (epoch_of(floor) + 1) << EPOCH_SHIFT
                out = [not g or (floor <= g < top and g not in fenced and g not in retired)
                       for g in gens]
            else:
                out = [not g or (g not in fenced and g not in retired) for g in gens]
            self.refused += out.count(False)
            return out

    def begin_write(self, gen: int) -> bool:
        """Admit a WRITE of ``gen`` and count it in progress until :meth:`end_write`."""
        if not gen:
            return True
        with self._lock:
            if not self._admit(gen):
                return False
            self._writing[gen] += 1
            return True

    def end_write(self, gen: int) -> None:
        """The WRITE admitted by :meth:`begin_write` is over (landed or abandoned)."""
        if not gen:
            return
        with self._lock:
            self._writing[gen] -= 1
            if self._writing[gen] <= 0:
                del self._writing[gen]

    def install(self, gens: list[int]) -> list[int]:
        """Fence ``gens`` (idempotent); returns those now safe to acknowledge.

        A generation with a WRITE still in progress is fenced (no new frame of it is admitted)
        but not returned: acknowledge it on a later call, once that WRITE is over.
        """
        with self._lock:
            for gen in gens:
                self._fenced[gen] = None
                self._fenced.move_to_end(gen)
            while len(self._fenced) > self._keep:
                self._fenced.popitem(last=False)
            return [g for g in gens if not self._writing.get(g)]

    def retire(self, gens: list[int]) -> None:
        """Refuse READs and WRITEs of ``gens`` from now on (idempotent; 0 is ignored). Frames
        already admitted finish."""
        with self._lock:
            for gen in gens:
                if gen:
                    self._retired[gen] = None
                    self._retired.move_to_end(gen)
            while len(self._retired) > self._keep:
                self._retired.popitem(last=False)

    def fenced(self, gen: int) -> bool:
        """True when ``gen`` is fenced."""
        with self._lock:
            return gen in self._fenced
