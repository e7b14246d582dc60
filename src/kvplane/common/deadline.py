"""Deadline: a monotonic point in time passed down through blocking calls."""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvplane.common.errors import Timeout


@dataclass(frozen=True, slots=True)
class Deadline:
    """An absolute monotonic deadline.

    Every public blocking call takes ``timeout`` (seconds) and turns it into a Deadline, so
    retries and nested calls can never outlive their caller.
    """

    at: float

    @classmethod
    def after(cls, timeout: float | None) -> Deadline:
        """A deadline ``timeout`` seconds from now (``None`` means one day, never unbounded)."""
        return cls(time.monotonic() + (86400.0 if timeout is None else max(0.0, timeout)))

    def remaining(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        """True once the deadline has passed."""
        return time.monotonic() >= self.at

    def check(self, what: str = "operation") -> float:
        """Return the seconds left, or raise Timeout if none are."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise Timeout(f"{what} timed out")
        return left
