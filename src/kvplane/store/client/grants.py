"""A tenant client's data-plane grants: installed at each segment before its transfers there.

The master answers a tenant's lookup, PutStart and remove with grants (``ResultsRep.grants``,
``CodesRep.grants``; ``kvplane.store.master.grants``); the client hands each segment's grants to
that segment's listener (``TransferEngine.grant``: one round trip per segment) before it reads,
writes or retires there. A grant that cannot be installed is not an error here: the transfers
it covers are refused and fail over like any failed transfer (a failed read is a miss).
A tenant's transfers all go through listeners (``tenant_transfers``): shared memory maps a
segment whole, and only the listener checks grants.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from kvplane.common.deadline import Deadline
from kvplane.common.errors import KVPlaneError
from kvplane.store.types import Grant
from kvplane.transfer import TransferEngine

log = logging.getLogger(__name__)


def install(engine: TransferEngine, handle_of: Callable[[str, Deadline], int],
            grants: list[Grant], deadline: Deadline) -> None:
    """Install ``grants`` at their segments' listeners (failures are logged, not raised).

    Args:
        engine: the engine whose listeners' peers get the grants.
        handle_of: the engine handle of a segment, opened within the deadline.
        grants: (segment, blob) pairs from the master's answer.
        deadline: the call's deadline.
    """
    by_segment: dict[str, list[bytes]] = {}
    for segment, blob in grants:
        by_segment.setdefault(segment, []).append(blob)
    for segment, blobs in by_segment.items():
        try:
            handle = handle_of(segment, deadline)
            codes = engine.grant(handle, b"".join(blobs),
                                 timeout=max(deadline.remaining(), 1e-3))
        except KVPlaneError as exc:
            log.debug("installing %d grants at %s failed: %s", len(blobs), segment, exc)
            continue
        if any(codes):
            log.debug("segment %s refused %d of %d grants", segment, sum(map(bool, codes)),
                      len(blobs))


def tenant_transfers(engine: TransferEngine) -> None:
    """Make every transfer of ``engine`` go through the peer's listener (TCP)."""
    if engine.config.protocol != "tcp":
        engine.config = dataclasses.replace(engine.config, protocol="tcp")
