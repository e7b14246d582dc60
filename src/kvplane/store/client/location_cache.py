"""Where this client last saw each key, and which of those places a read lease holds.

The cache the get path speculates on (``get_path``): a bounded dict in insertion order
(``StoreConfig.location_cache`` keys; 0 turns speculation off), filled by gets and by this
client's committed puts, emptied by its removes. A key may also be *held*: the place a lookup
named or confirmed, with the local time that lookup's read lease ends (``get_path`` says what a
hold allows). Pure data: imports only the store's record types.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable

from kvplane.store.types import Location, Replica

# A key's held place and the local time the lease that holds it ends. A plain pair, not a
# NamedTuple: a speculative get through shared memory holds every key it reads, and building
# a NamedTuple costs CPython 3.11 about 8x a tuple's (0.36 us against 0.04 us per key).
Hold = tuple[Location, float]


class Locations:
    """At most ``capacity`` keys' last known replica; the oldest entries go first. A key may
    also be *held*: the place a lookup named or confirmed, with the local time that lookup's
    read lease ends. A hold is of that place only: a newer place of the key (this client's own
    put) is not held by it.

    ``known`` and ``holds`` are the two maps, public for the get path to read without a call
    (one dict lookup per key); every change goes through the methods, under the lock.
    """

    __slots__ = ("capacity", "known", "holds", "_lock", "failovers")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.known: dict[str, Location] = {}
        self.holds: dict[str, Hold] = {}
        self._lock = threading.Lock()  # mutations (a lookup is one dict operation)
        self.failovers = 0  # the master link's leader changes when the holds were granted

    def __len__(self) -> int:
        return len(self.known)

    def get(self, key: str) -> Location | None:
        """The place this client last saw ``key`` at, or None."""
        return self.known.get(key)

    def learn(self, keys: Iterable[str], replicas: Iterable[Replica], sizes: Iterable[int],
              until: float | None = None) -> None:
        """Remember that each key's object (of that size) is at that replica."""
        self.put(keys, [Location(r.segment, r.addr, r.gen, n) for r, n in zip(replicas, sizes)],
                 until)

    def put(self, keys: Iterable[str], locs: list[Location], until: float | None = None) -> None:
        """Remember each key's location; ``until``: the local time the read lease of the
        lookup that named it ends (None: no lease, e.g. this client's own put)."""
        m, held = self.known, self.holds
        keys = list(keys)
        with self._lock:
            m.update(zip(keys, locs))
            if until is not None:
                held.update(zip(keys, [(loc, until) for loc in locs]))
            elif held:
                for k in keys:
                    held.pop(k, None)
            over = len(m) - self.capacity
            if over > 0:
                for k in list(itertools.islice(m, over)):
                    del m[k]
                    held.pop(k, None)

    def hold(self, keys: Iterable[str], locs: Iterable[Location], until: float) -> None:
        """A lookup that granted a lease until ``until`` confirmed that each key is at that
        place: held, unless the key has moved on since (or was forgotten)."""
        m, held = self.known, self.holds
        with self._lock:
            for k, loc in zip(keys, locs):
                if m.get(k) == loc:
                    held[k] = (loc, until)

    def held(self, key: str) -> Hold | None:
        """The place ``key`` is held at and the local time its lease ends, or None."""
        return self.holds.get(key)

    def held_until(self, keys: list[str], locs: list[Location], fresh: float) -> float | None:
        """The earliest lease end of ``keys`` when every one is held at its place in ``locs``
        for at least ``fresh`` more seconds, else None."""
        held = self.holds
        if not held:
            return None
        until = float("inf")
        for k, loc in zip(keys, locs):
            h = held.get(k)
            if h is None or h[0] != loc:
                return None
            if h[1] < until:
                until = h[1]
        return until if until - time.monotonic() > fresh else None

    def drop_holds(self) -> None:
        """Forget every hold (the master restarted or the leader changed)."""
        with self._lock:
            self.holds.clear()

    def forget(self, keys: Iterable[str]) -> None:
        """Forget the places (and holds) of ``keys``."""
        m, held = self.known, self.holds
        with self._lock:
            for k in keys:
                m.pop(k, None)
                held.pop(k, None)

    def clear(self) -> None:
        """Forget every place and hold."""
        with self._lock:
            self.known.clear()
            self.holds.clear()


def confirmed(loc: Location, replicas: list[Replica], size: int) -> bool:
    """True if the master's ``replicas`` (and ``size``) for a key include the allocation at
    ``loc``: the bytes read from there are the key's object."""
    seg, addr, gen, n = loc
    if n != size:
        return False
    for r in replicas:
        if r.gen == gen and r.addr == addr and r.segment == seg:
            return True
    return False
