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

**Lanes.** A segment shared by the shards of a sharded store master (``kvplane.store.shard``)
serves one master per shard, each with its own epoch: the fence keeps a floor per *lane* (the
shard id; 0 for a pool of one master) and admits a generation when the lane serving its epoch
admits it. Lanes are independent: a new epoch on one lane (its shard failed over) refuses that
lane's old generations and leaves the others' alone.

Same-host writers copy through shared memory, where no listener mediates: ``attach`` names the
``FENCE_BYTES`` at the start of this segment's shared memory, where the fence publishes each
lane's floor (which carries its epoch) as an 8-byte word (lane ``i`` at word ``i``), and the
shared-memory transport checks a generation against them before and after each copy
(``admits_words``). Pure bookkeeping under one lock; imports no sockets and nothing from the
store.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict

EPOCH_SHIFT = 40
COUNTER_MASK = (1 << EPOCH_SHIFT) - 1
KEEP = 1 << 20  # fenced generations remembered per epoch (oldest forgotten first)
NEVER = 1 << 64  # above every generation: the floor of an epoch no lane serves
LANES = 64  # masters one segment can serve at once (the shards of a sharded pool)
FENCE_BYTES = 8 * LANES  # the floors published in a fenced region: one 8-byte word per lane


def epoch_of(gen: int) -> int:
    """The master epoch a generation was issued in."""
    return gen >> EPOCH_SHIFT


def admits(floor: int, gen: int) -> bool:
    """True when a fence at ``floor`` (0: not mounted) admits generation ``gen`` (0: unfenced),
    fenced generations aside: same epoch as the floor, and not below it."""
    return not gen or not floor or floor <= gen < (epoch_of(floor) + 1) << EPOCH_SHIFT


def admits_words(words: list[int], gen: int) -> bool:
    """True when the lanes' floors ``words`` (as published: 0 for a lane not in use) admit
    ``gen``: every lane unused (not mounted) admits anything, else the lane serving ``gen``'s
    epoch must, fenced generations aside."""
    if not gen:
        return True
    epoch = gen >> EPOCH_SHIFT
    for floor in words:
        if floor >> EPOCH_SHIFT == epoch:
            return floor <= gen
    return not any(words)


class Fence:
    """The fence table of one data listener. Thread-safe.

    Args:
        keep: how many fenced generations to remember (a bound on memory).
    """

    def __init__(self, keep: int = KEEP) -> None:
        self._lock = threading.Lock()
        self._keep = keep
        self.epoch = 0  # lane 0's: 0 while not mounted with a master (every epoch admitted)
        self.floor = 0  # lowest generation lane 0 admits (its epoch is ``epoch``)
        self._lanes: dict[int, int] = {}  # lane -> its floor (mounted lanes only)
        self._floors: dict[int, int] = {}  # epoch -> the floor of the lane serving it
        self._word: memoryview | None = None  # shared-memory copy of the lanes' floors
        self._fenced: OrderedDict[int, None] = OrderedDict()
        self._retired: OrderedDict[int, None] = OrderedDict()
        self._writing: Counter[int] = Counter()
        self.refused = 0

    def set_epoch(self, epoch: int, floor: int = 0, lane: int = 0) -> None:
        """Serve the master of ``epoch`` on ``lane`` from now on, generations from ``floor`` up
        (0: the whole epoch; epoch 0: the lane serves no master). Fences of the lane's older
        epoch are dropped (their frames fail the epoch check instead).

        Raises:
            ValueError: ``lane`` is outside ``0..LANES-1``.
        """
        if not 0 <= lane < LANES:
            raise ValueError(f"fence lane {lane} is outside 0..{LANES - 1}")
        floor = max(floor, epoch << EPOCH_SHIFT) if epoch else 0
        with self._lock:
            old = self._lanes.get(lane, 0) >> EPOCH_SHIFT
            if epoch != old and old:
                self._drop_epoch(old)
            if floor:
                self._lanes[lane] = floor
            else:
                self._lanes.pop(lane, None)
            self._floors = {f >> EPOCH_SHIFT: f for f in self._lanes.values()}
            if lane == 0:
                self.epoch, self.floor = epoch, floor
            if self._word is not None:
                self._word[8 * lane:8 * lane + 8] = floor.to_bytes(8, "little")

    def _drop_epoch(self, epoch: int) -> None:
        """Forget fences and retirements of ``epoch`` (under the lock)."""
        for table in (self._fenced, self._retired):
            for g in [g for g in table if g >> EPOCH_SHIFT == epoch]:
                del table[g]

    def attach(self, word: memoryview) -> None:
        """Publish the lanes' floors into ``word`` (the first ``FENCE_BYTES`` of this segment's
        shared memory; 8 bytes is enough for lane 0 alone)."""
        with self._lock:
            self._word = word
            word[:] = bytes(len(word))
            for lane, floor in self._lanes.items():
                if 8 * lane + 8 <= len(word):
                    word[8 * lane:8 * lane + 8] = floor.to_bytes(8, "little")

    def lanes(self) -> dict[int, int]:
        """The mounted lanes and their floors."""
        with self._lock:
            return dict(self._lanes)

    def _admits(self, gen: int) -> bool:
        """The floor check alone (under the lock)."""
        if not gen or not self._floors:
            return True
        floor = self._floors.get(gen >> EPOCH_SHIFT)
        return floor is not None and floor <= gen

    def writing_outside(self) -> int:
        """WRITEs in progress that the current floors would refuse (admitted before a remount)."""
        with self._lock:
            return sum(n for g, n in self._writing.items() if not self._admits(g))

    def _admit(self, gen: int) -> bool:
        ok = self._admits(gen) and gen not in self._fenced and gen not in self._retired
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
            floors, fenced, retired = self._floors, self._fenced, self._retired
            if len(floors) == 1:  # one master (or one shard mounted): the common case
                floor = next(iter(floors.values()))
                top = (epoch_of(floor) + 1) << EPOCH_SHIFT
                out = [not g or (floor <= g < top and g not in fenced and g not in retired)
                       for g in gens]
            elif floors:
                out = [not g or (floors.get(g >> EPOCH_SHIFT, NEVER) <= g
                                 and g not in fenced and g not in retired) for g in gens]
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
