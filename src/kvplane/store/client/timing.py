"""Time arithmetic every layer of a store client shares: socket-friendly timeouts and reads
bounded by a read lease.

A read under a lease is given until ``MARGIN`` before the lease ends (counted from before the
lookup was sent, so it ends no later than the master's), and is taken only if it returned
inside it (``ended_in``): a read that returned later may have read space the master had handed
to another object. Imports only ``kvplane.common``; nothing of the client.
"""

from __future__ import annotations

import math
import time

from kvplane.common.deadline import Deadline

GRAIN = 0.05  # timeouts handed to sockets are rounded down to this
MARGIN = GRAIN  # a lease-bounded read is given until this long before its lease ends


def coarse(seconds: float) -> float:
    """``seconds`` rounded down to ``GRAIN`` (above 0.2 s), so consecutive calls hand the same
    timeout to sockets that re-arm their kernel timeouts only when it changes."""
    return seconds if seconds < 0.2 else math.floor(seconds / GRAIN) * GRAIN


def lease_bound(deadline: Deadline, lease_end: float) -> Deadline:
    """The deadline of a read under a lease that ends at (local) ``lease_end``: the call's,
    or ``MARGIN`` before the lease ends if that is sooner."""
    return Deadline(min(deadline.at, lease_end - MARGIN))


def ended_in(lease_end: float) -> bool:
    """True if a read that has just returned ended inside the lease ending at ``lease_end``
    (by this client's clock, counted from before the lookup was sent: no later than the
    master's). A read that returns later may have read space the master gave to another
    object: its bytes must not be returned."""
    return time.monotonic() < lease_end
