"""What the master's RPC modules are handed: the state being served, the clock, and the shape
of a handler table.

The server builds one :class:`Serving` at start and replaces its ``state`` when a leader term
starts or ends; an RPC module (``replica_rpc.py``, ``tier_rpc.py``) keeps the ``Serving`` and
reads ``serving.state`` per call, so it never holds the server. Each RPC module exports
``handlers(serving) -> Handlers``; the server registers every entry once, at start, behind its
lock, counters and access checks (``MasterServer.add_handler``).

Pure: no I/O, no clock reads of its own. Sits above the state (``state.py``); must not import an
RPC module or the server.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvplane.store.master.state import MasterState

Handler = Callable[[Any], Any]
# RPC method name -> (handler, the request type its payload decodes as)
Handlers = dict[str, tuple[Handler, type[Any]]]


@dataclass(slots=True)
class Serving:
    """The state the master serves now (replaced on a leader change) and its clock.

    Args:
        state: the master state every handler works on, under the server's lock.
        clock: the server's monotonic clock (tests inject one).
    """

    state: MasterState
    clock: Callable[[], float]
