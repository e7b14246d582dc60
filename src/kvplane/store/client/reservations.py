"""Put reservations: PutStart, retried while the SSD tier makes room.

When the pool is full of objects whose disk copies are still being written, PutStart answers
NoAvailableHandle with ``retry_after``; the client retries those keys after that pause while
its deadline lasts, instead of failing at once. Every PutStart carries a fresh nonce (the
master answers a repeated one from memory), the generations this client retired and the spares
it gives back. Imports ``context`` only.
"""

from __future__ import annotations

import secrets
import time

from kvplane.common.deadline import Deadline
from kvplane.store.client.context import ClientContext
from kvplane.store.errors import NoAvailableHandle
from kvplane.store.types import PutStartReq, ReplicateConfig, ResultsRep


def put_start(ctx: ClientContext, keys: list[str], sizes: list[int], cfg: ReplicateConfig,
              upsert: bool, sums: list[int], deadline: Deadline) -> ResultsRep:
    """PutStart, retrying keys the master could not place yet while offloads make room."""
    rep = ctx.call("put_start", PutStartReq(
        ctx.config.client_id, keys, sizes, cfg, upsert, deadline.remaining(), sums,
        secrets.randbits(63) | 1, ctx.retired.take(), ctx.spares.returns()), ResultsRep,
        deadline)
    while rep.retry_after > 0:
        full = [i for i, r in enumerate(rep.results) if r.code == NoAvailableHandle.code]
        if not full or deadline.remaining() <= rep.retry_after + 0.5:
            break
        time.sleep(rep.retry_after)
        again = ctx.call("put_start", PutStartReq(
            ctx.config.client_id, [keys[i] for i in full], [sizes[i] for i in full], cfg,
            upsert, deadline.remaining(), [sums[i] for i in full], secrets.randbits(63) | 1),
            ResultsRep, deadline)
        results = list(rep.results)
        for i, r in zip(full, again.results):
            results[i] = r
        retire = (rep.retire or []) + [(full[j], s, g) for j, s, g in again.retire or []]
        rep = ResultsRep(results, again.ttl, again.retry_after, retire=retire or None)
    return rep
