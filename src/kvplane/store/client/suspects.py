"""What a store client tells the master about segments with its next RPC: the segments a
transfer failed on (``Suspects``) and the generations it had segments refuse (``Retired``).

Both are thread-safe bags that the RPCs drain (``take``). Imports nothing of the client.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

BAD_FOR = 5.0  # seconds a failed segment is tried last by this client


class Retired:
    """(segment, generation) pairs this client had refused at their segments, to tell the
    master with its next PutStart or heartbeat (``PutStartReq.retired``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pairs: list[tuple[str, int]] = []

    def add(self, pairs: list[tuple[str, int]]) -> None:
        """Queue ``pairs`` for the next report."""
        with self._lock:
            self._pairs += pairs

    def take(self) -> list[tuple[str, int]]:
        """The pairs to report with the next RPC (cleared)."""
        if not self._pairs:
            return []
        with self._lock:
            out, self._pairs = self._pairs, []
        return out


class Suspects:
    """Segments this client saw fail: tried last locally, reported to the master once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._report: set[str] = set()
        self._until: dict[str, float] = {}

    def add(self, segments: Iterable[str]) -> None:
        """Remember ``segments`` as failed for ``BAD_FOR`` seconds, and report them."""
        now = time.monotonic()
        with self._lock:
            for s in segments:
                self._report.add(s)
                self._until[s] = now + BAD_FOR

    def take(self) -> list[str]:
        """The segments to report with the next RPC (cleared)."""
        if not self._report:
            return []
        with self._lock:
            out, self._report = sorted(self._report), set()
        return out

    def any(self) -> bool:
        """True while some segment is remembered as failed."""
        return bool(self._until)

    def bad(self, segment: str) -> bool:
        """True while ``segment`` is remembered as failed."""
        until = self._until.get(segment)
        if until is None:
            return False
        if until > time.monotonic():
            return True
        self._until.pop(segment, None)  # expired: forget it (keeps ``any`` cheap)
        return False
