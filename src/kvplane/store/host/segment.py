"""The memory a hosting client contributes to the pool, as the master's mount record names it.

The first ``FENCE_WORD`` bytes of the managed buffer hold the segment's fence words (the floor,
with its epoch, of each master the segment serves, that shared-memory writers check:
``kvplane.transfer.fence``) and are never allocated. Imports the client's ``context``.
"""

from __future__ import annotations

from kvplane.store.client.context import ClientContext
from kvplane.store.errors import InvalidParams
from kvplane.store.types import SegmentInfo
from kvplane.transfer.fence import FENCE_BYTES

FENCE_WORD = FENCE_BYTES  # bytes at the start of a contributed segment: its fence words


def contribute(ctx: ClientContext) -> SegmentInfo:
    """Allocate the segment of ``config.global_segment_size`` bytes (fenced) and describe it.

    Raises:
        InvalidParams: the size leaves no room past the fence word.
    """
    cfg, engine = ctx.config, ctx.engine
    if cfg.global_segment_size <= 2 * FENCE_WORD:
        raise InvalidParams("global_segment_size is too small")
    buf = engine.allocate_managed_buffer(cfg.global_segment_size, populate=cfg.populate,
                                         fenced=True)
    return SegmentInfo(engine.name, buf.addr + FENCE_WORD, cfg.global_segment_size - FENCE_WORD,
                       cfg.client_id, engine.name, engine.host_id)
