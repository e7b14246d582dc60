"""The put path: reserve, write every replica, commit (or revoke), under one deadline.

A put is PutStart (the master places replicas; ``reservations``) -> the writes of each header
and value into every replica (``replica_io.put_write``) -> PutEnd, or PutRevoke for what could not
be written. A put of one small object that fits the spare this client holds skips PutStart
(``put_through_spare``; ``spares`` has the rules). Every put is checksummed: the inventory header
carries it, and a segment re-registers an object after a failover only if its bytes still match.
A share of the call's time (``WRITE_RESERVE``, at most 1 s) is kept for the commit. Imports
``context``, ``replica_io``, ``lookup`` (what a committed put teaches the location cache) and
``reservations``.
"""

from __future__ import annotations

import time

from kvplane.common import metrics
from kvplane.common.deadline import Deadline
from kvplane.common.errors import KVPlaneError
from kvplane.store import inventory
from kvplane.store.checksum import digest
from kvplane.store.client import spares
from kvplane.store.client.context import ClientContext
from kvplane.store.client.lookup import remember
from kvplane.store.client.replica_io import put_write, retire
from kvplane.store.client.reservations import put_start
from kvplane.store.errors import ObjectExists, ObjectNotFound, TransferFail, ValueTooLarge, key_error
from kvplane.store.types import CodesRep, KeyResult, PutEndReq, ReplicateConfig, ResultsRep, SpareAsk

PUTS = metrics.Counter(
    "kvplane_store_spare_puts_total", "Puts that wrote into a spare, by outcome (committed: two "
    "round trips; put_anew: the spare's write failed or the master no longer had it, and the "
    "put went the usual way)", ["outcome"])
_COMMITTED, _ANEW = PUTS.labels("committed"), PUTS.labels("put_anew")
WRITE_RESERVE = 0.2  # share of a put's time (at most 1 s) kept for PutEnd / PutRevoke


def put_many(ctx: ClientContext, keys: list[str], addrs: list[int], sizes: list[int],
             cfg: ReplicateConfig, upsert: bool) -> list[KVPlaneError | None]:
    """``batch_put_from`` of registered memory: per key None (stored, or already there) or the
    exception it failed with."""
    codes = put_codes(ctx, keys, addrs, sizes, cfg, upsert)
    return [None if c in (0, ObjectExists.code) else _put_error(ctx, c, k, n)
            for k, c, n in zip(keys, codes, sizes)]


def _put_error(ctx: ClientContext, code: int, key: str, size: int) -> KVPlaneError:
    if code == ValueTooLarge.code:  # the master named its largest segment with the code
        return ValueTooLarge(ValueTooLarge.message(key, size, ctx.largest_segment))
    return key_error(code, key)


def put_codes(ctx: ClientContext, keys: list[str], addrs: list[int], sizes: list[int],
              cfg: ReplicateConfig, upsert: bool) -> list[int]:
    """Put ``keys``; per key 0 or the store code it failed with (see the module docstring)."""
    deadline = Deadline.after(ctx.config.timeout)
    sums = [digest(ctx.engine.memory.view(a, n)) for a, n in zip(addrs, sizes)]
    reserve = min(WRITE_RESERVE * ctx.config.timeout, 1.0)
    shape = spares.ask(keys, sizes, cfg, upsert) if ctx.spares.enabled else None
    if shape is not None:  # write into the spare the last PutEnd placed, then commit
        code = put_through_spare(ctx, keys[0], addrs[0], sizes[0], cfg, sums[0], shape,
                                 deadline, reserve)
        if code is not None:
            return [code]
    sent = time.monotonic()
    rep = put_start(ctx, keys, sizes, cfg, upsert, sums, deadline)
    codes = [r.code for r in rep.results]
    for r in rep.results:
        if r.code == ValueTooLarge.code:
            ctx.largest_segment = r.size
    unretired = retire(ctx, rep.retire, deadline) if rep.retire else set()
    ok = [i for i, c in enumerate(codes) if c == 0 and i not in unretired]
    window = sent + rep.ttl if rep.ttl > 0 else deadline.at  # copies must start inside it
    failed = put_write(ctx, rep.results, ok, addrs, sizes,
                       Deadline(min(deadline.at - reserve, window)))
    failed |= {i for i in unretired if codes[i] == 0}  # not made safe: not committed
    _commit(ctx, keys, rep, [i for i in ok if i not in failed], sorted(failed), sums, shape,
            codes, deadline)
    for i in failed:
        codes[i] = TransferFail.code
    remember(ctx, keys, rep.results, [i for i in ok if codes[i] == 0], sizes)
    return codes


def _commit(ctx: ClientContext, keys: list[str], rep: ResultsRep, written: list[int],
            failed: list[int], sums: list[int], shape: SpareAsk | None, codes: list[int],
            deadline: Deadline) -> None:
    """PutEnd of the keys ``written`` (a key the master did not commit fails in ``codes``),
    PutRevoke of those ``failed``; a PutEnd that asks for a spare holds the one it sends."""
    results = rep.results
    if written:
        sent = time.monotonic()
        end = ctx.call("put_end", PutEndReq(
            ctx.config.client_id, [keys[i] for i in written], [results[i].version for i in written],
            [sums[i] for i in written], ctx.suspects.take(), spare=shape,
            returns=ctx.spares.returns()), CodesRep, deadline)
        if shape is not None:
            ctx.spares.offer(end.spare, shape, sent)
        for i, code in zip(written, end.codes):
            if code:  # not committed (pre-empted, or lost with its segment): not a success
                codes[i] = TransferFail.code
    if failed:
        ctx.call("put_revoke", PutEndReq(ctx.config.client_id, [keys[i] for i in failed],
                                         [results[i].version for i in failed], [],
                                         ctx.suspects.take(), returns=ctx.spares.returns()),
                 CodesRep, deadline)


def put_through_spare(ctx: ClientContext, key: str, addr: int, size: int, cfg: ReplicateConfig,
                      checksum: int, shape: SpareAsk, deadline: Deadline,
                      reserve: float) -> int | None:
    """Put one object through the held spare: its code (0, ObjectExists...), or None when no
    spare fits, its write failed or the master no longer had it (the caller puts the usual
    way, within the same deadline)."""
    held = ctx.spares.take(shape, time.monotonic())
    if held is None:
        return None
    spare, window_end = held
    r = spare.result
    header = inventory.pack(spare.secret, key, r.version, r.version, size, checksum,
                            cfg.replica_num, inventory.FLAG_HARD_PIN if cfg.with_hard_pin else 0)
    res = [KeyResult(0, r.replicas, size, r.version, checksum, header)]
    # at most half the call's time, and no blame: a segment that remounted with a new master
    # refuses the spare's old generation and is healthy; the usual way's own write blames a
    # segment that is not (and finds it with the other half)
    now = time.monotonic()
    failed = put_write(ctx, res, [0], [addr], [size], Deadline(min(
        deadline.at - reserve, window_end, now + (deadline.at - now) / 2)), blame_failed=False)
    if failed:
        ctx.spares.give_back(spare)
        _ANEW.inc()
        return None
    sent = time.monotonic()
    rep = ctx.call("put_end", PutEndReq(
        ctx.config.client_id, [key], [r.version], [checksum], ctx.suspects.take(),
        [spare.name], shape, ctx.spares.returns()), CodesRep, deadline)
    ctx.spares.offer(rep.spare, shape, sent)
    code = rep.codes[0]
    if code == ObjectNotFound.code:  # the spare was gone (a new master, a lost segment)
        _ANEW.inc()
        return None
    ctx.spares.used += 1
    _COMMITTED.inc()
    if code == 0:
        remember(ctx, [key], res, [0], [size])
    return code
