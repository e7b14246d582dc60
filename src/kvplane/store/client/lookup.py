"""The master's lookup of keys (GetReplicaList) and what this client learns from its answer.

``lookup`` sends it (bounded by the call's deadline, with the speculative read of ``get_path``
run while the master answers) and returns the answer with the local time its read lease ends;
``expand`` turns a short answer (columns, or only the keys not where the client expected them)
into one result per key; ``remember`` puts the places of found keys into the location cache.
Disk-only objects are the next layer's (``read_through``). Imports ``context`` and
``replica_io`` (the replica order) only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import cast

from kvplane.common.deadline import Deadline
from kvplane.common.errors import Unavailable
from kvplane.store.client.context import ClientContext
from kvplane.store.client.replica_io import ordered
from kvplane.store.types import (
    CodesRep,
    Columns,
    KeyResult,
    KeysReq,
    Location,
    ResultsRep,
    column_results,
)


def lookup(ctx: ClientContext, keys: list[str], deadline: Deadline,
           meanwhile: Callable[[], None] | None = None,
           expect: list[Location | None] | None = None,
           columns: bool = False) -> tuple[ResultsRep, float]:
    """The master's answer to a lookup of ``keys`` and the local time its read lease ends
    (the master's TTL, counted from before the request was sent).

    Args:
        ctx: the client's context.
        keys: the keys to look up.
        deadline: the call's deadline.
        meanwhile: run while the master answers (``MasterLink.call``).
        expect: per key the place it was read from meanwhile (``KeysReq.expect``).
        columns: take the answer as columns when it can be (never with checksums on: the
            columns carry none).

    Returns:
        (the answer, the local end of its read lease).
    """
    sent = time.monotonic()
    columns = columns and not ctx.config.checksum
    rep = ctx.call("get_replicas", KeysReq(ctx.config.client_id, list(keys),
                                           ctx.suspects.take(), expect, columns),
                   ResultsRep, deadline, meanwhile)
    if rep.ttl > 0:
        ctx.lease_ttl = rep.ttl
    return rep, sent + ctx.lease_ttl


def expand(keys: list[str], rep: ResultsRep) -> list[KeyResult | None]:
    """Per key the result in ``rep``: None for a key confirmed where it was expected.

    Raises:
        Unavailable: the answer's list of stale keys does not match its results.
    """
    if rep.columns is not None:
        return cast("list[KeyResult | None]", column_results(rep.columns))
    if rep.stale is None:  # (the answer's own list: no copy on the hot path)
        return cast("list[KeyResult | None]", rep.results)
    if len(rep.stale) != len(rep.results):
        raise Unavailable("the master's answer does not match its list of keys")
    full: list[KeyResult | None] = [None] * len(keys)
    for i, r in zip(rep.stale, rep.results):
        full[i] = r
    return full


def remember(ctx: ClientContext, keys: list[str], results: list[KeyResult], which: list[int],
             sizes: list[int] | None = None, until: float | None = None) -> None:
    """Remember where the found keys among ``which`` are: the replica a read tries first (same
    host first). ``sizes``: the objects' sizes when ``results`` do not carry them (a put's);
    ``until``: the local end of the read lease the lookup granted (None: none, a put)."""
    if not ctx.locations.capacity:
        return
    found = [i for i in which if not results[i].code and results[i].replicas]
    if found:
        ctx.locations.learn([keys[i] for i in found],
                            [ordered(ctx, results[i].replicas)[0] for i in found],
                            [results[i].size if sizes is None else sizes[i] for i in found],
                            until)


def exists(ctx: ClientContext, keys: list[str], deadline: Deadline) -> list[bool]:
    """Per key, whether a complete object exists (Mooncake's ExistKey: each hit takes a read
    lease). When this client holds places (location cache and held reads on, checksums off)
    it asks for them too: if every key is a plain object the answer names where each is,
    under that same lease, and the keys are held from then on, so the get that usually
    follows reads them without asking the master (``get_path.held_one``)."""
    want = bool(ctx.locations.capacity and ctx.config.held_reads and not ctx.config.checksum)
    sent = time.monotonic()
    rep = ctx.call("exist", KeysReq(ctx.config.client_id, list(keys), ctx.suspects.take(),
                                    columns=want), CodesRep, deadline)
    if want and rep.columns is not None and rep.ttl > 0 and len(rep.codes) == len(keys):
        hold_columns(ctx, keys, rep.columns, sent + rep.ttl)
    return [c == 1 for c in rep.codes]


def hold_columns(ctx: ClientContext, keys: list[str], cols: Columns, until: float) -> None:
    """Remember (and hold until ``until``) the places ``cols`` names for ``keys``."""
    names = cols.segments
    ctx.locations.put(keys, [Location(names[s], a, g, n) for s, a, g, n in
                             zip(cols.seg, cols.addr, cols.gen, cols.size)], until)
