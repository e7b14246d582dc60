"""A put in two round trips: the write, then a PutEnd that commits a spare under the put's key.

The master places an object one put ahead when a PutEnd asks (``kvplane.store.master.spares``
has the rules). A put of one object that fits the spare this client holds (same size, same
header length, same config), begun well inside the spare's write window, builds its own
inventory header (keyed by the secret the spare came with), writes header and value into the
spare's replicas, and commits them with one PutEnd, which asks for the next spare. Anything
else, a spare whose write fails, and a commit that finds its spare gone (a master restart or
a leader change, a segment lost), goes the usual way: PutStart, write, PutEnd. Off with
``KVPLANE_STORE_SPARES=0``.

What the two ways share: the checksum in the header, the write window, the fence on the
segment (the spare's generation), and that the object is readable only once the master's
commit says so.

This module holds the spare (``Spares``) and the shape a put would need (``ask``); the put through
a spare is ``put_path``'s. Imports only store types and the inventory header's size.
"""

from __future__ import annotations

import threading

from kvplane.store import inventory
from kvplane.store.types import ReplicateConfig, Spare, SpareAsk

MAX_SPARE = 1 << 20  # bytes of value (as the master's limit): larger puts gain nothing from it
MIN_WINDOW = 0.5  # seconds of the spare's write window a put needs left to begin in it


def ask(keys: list[str], sizes: list[int], cfg: ReplicateConfig, upsert: bool) -> SpareAsk | None:
    """The spare a put of ``keys`` would use and ask for next (one small object, no upsert)."""
    if len(keys) != 1 or upsert or not 0 < sizes[0] <= MAX_SPARE:
        return None
    return SpareAsk(sizes[0], inventory.header_len(keys[0]), cfg)


# A spare taken for a put and the local time its write window ends; and the held spare with its
# shape and window end. Plain tuples: one is made per spare put, and a NamedTuple costs CPython
# 3.11 about 8x a tuple's to build.
Taken = tuple[Spare, float]
_Held = tuple[Spare, SpareAsk, float]


class Spares:
    """The spare this client holds (at most one), and those it gives back with its next PutEnd."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._lock = threading.Lock()
        self._held: _Held | None = None
        self._returns: list[tuple[str, int, bool]] = []  # name, version, written into
        self.used = 0  # puts that went through a spare (tests and benchmarks read it)

    def take(self, shape: SpareAsk, now: float) -> Taken | None:
        """The held spare and its window's local end, if it fits ``shape`` with time to begin
        writing; a spare of another shape or past its window is given back."""
        with self._lock:
            held = self._held
            if held is None:
                return None
            self._held = None
            spare, have, end = held
            if have == shape and end - now > MIN_WINDOW:
                return spare, end
            self._give(spare, False)
            return None

    def offer(self, spare: Spare | None, shape: SpareAsk, sent: float) -> None:
        """Hold the spare a PutEnd sent back (its window counted from before the request)."""
        if spare is None or spare.result.code or not spare.result.replicas:
            return
        with self._lock:
            if self._held is not None:  # another thread's: keep the newer, give back the other
                self._give(self._held[0], False)
            self._held = (spare, shape, sent + spare.window)

    def give_back(self, spare: Spare) -> None:
        """A spare whose write failed (its space waits for the segment's fence)."""
        with self._lock:
            self._give(spare, True)

    def returns(self) -> list[tuple[str, int, bool]]:
        """The spares to give back with the next PutEnd (taken: send them)."""
        with self._lock:
            out, self._returns = self._returns, []
            return out

    def close(self) -> list[tuple[str, int, bool]]:
        """Everything this client still has: to give back as it closes (or to forget, when
        the master that made them is gone)."""
        with self._lock:
            if self._held is not None:
                self._give(self._held[0], False)
            out, self._held, self._returns = self._returns, None, []
            return out

    def _give(self, spare: Spare, written: bool) -> None:
        """Queue ``spare`` to go back (the caller holds the lock)."""
        self._returns.append((spare.name, spare.result.version, written))
