"""The get path: held reads, speculative reads while the master answers, and reads by its answer.

A get is two round trips when done in order: the master's lookup, then the read from the
replica. For a key whose replica this client already knows (from an earlier get, or from its
own put), ``batch_get_into`` sends the lookup and, while the master answers, reads the key from
that replica (``RpcClient.call(meanwhile=...)``): the two round trips overlap.

The bytes are taken only if the master's answer names the very allocation that was read: the
same segment, address and generation. A generation is given to one allocation only and never
comes back, and an allocation's bytes do not change once its put has ended. If the master still
lists that generation for the key, the allocation held the key's object from when this client
learned of it until the lookup, and the lookup's lease keeps it from being reused after that:
whichever came first, the read or the lookup, the bytes are the object's, provided the read
ended before that lease did. So the lease of the lookup the read overlaps is what covers it (an
earlier hold may have ended before the read began). The read is given until ``timing.MARGIN``
before that lease ends (counted from before the lookup was sent), and a read that returns
after the lease the answer grants has ended is not taken: a stalled segment may have served it
from space the master had handed to another object. Otherwise (the key was removed, replaced, moved to
disk, re-registered under a new epoch, or the read failed) the key is read again from the
master's answer, as without this cache. A read that was not confirmed may have written into the
caller's buffer; its key then ends as it would have without the speculation (the master's
bytes, or the error it reports for that key).

The lookup names the location each key was read from (``KeysReq.expect``). The master applies
that rule itself and answers only the keys that fail it, so a confirmed key costs no replica
list on the wire. A confirmed key whose read failed is looked up again. With checksums on,
every key is answered in full: the answer carries the checksum to verify.

A speculative read gets at most half of the call's time, and never more than that lease (above):
a segment that stalls leaves the rest to read another replica, and one where the read timed
out is suspect (``replica_io.blame``): no speculation on it while it is.

The cache is a bounded dict in insertion order (``StoreConfig.location_cache`` keys; 0 turns
speculation off). Entries come from gets and from this client's committed puts, and go with its
removes.

**Held reads.** A lookup grants a read lease (the master's ``lease_ttl``, 10 s). While it runs
the master neither evicts the object nor removes it without ``force``, nor hands its space to
another object (``fences.Quarantine``), so the place holds the key's value. A key whose place
this client learned or had confirmed by such a lookup is *held* until the lease ends (counted
from before the lookup was sent). A get of keys that are all held, with more than half of
their lease left, reads them without asking the master at all: one round trip (given until
``timing.MARGIN`` before the hold's lease ends; one that returns after it ended is not taken,
and the keys are looked up). The lease is
refreshed (and the LRU told) by the next get past the half, which goes the speculative way.

What could change the value under a running lease is covered so that no held read returns it
once that change has returned:

* an upsert that replaces a leased object, or a forced remove of one: the master names the old
  replicas (``types.Retire``) and the caller has their segments refuse the old generation
  (``TransferEngine.retire``) before its call returns; an upsert that cannot reach a segment
  fails for that key. The master also fences the generation through the owner's heartbeat,
  and hands the space out before the lease ends only once that fence is acknowledged;
* ``remove_all``/``remove_by_regex`` with ``force``: by that heartbeat fence only, so for up to a
  heartbeat after they return a held read may still return the removed value;
* a segment that dies or remounts, a master restart or a leader change: the segment refuses
  generations of an older epoch once it has remounted, and this client drops every hold when
  its heartbeat is told to remount or its link follows a new leader.

Held reads go only where the segment's listener checks generations (TCP): shared memory and
this client's own segment are copied without a listener, so those keys take the speculative
way. A held read that fails or is refused is looked up (the key's place is forgotten). With
checksums on there are no held reads (the master's answer carries the checksum to verify).

``get_into`` is ``batch_get_into``'s path, ``held_one`` the single get's first try, and
``get_copies`` the copying ``get_batch``. The places come from ``location_cache``; lookups
from ``lookup`` and ``read_through``; the transfers from ``replica_io``. Imports only those
layers below it (``kvplane.store.client.LAYERS``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import cast

from kvplane.common import metrics
from kvplane.common.deadline import Deadline
from kvplane.common.errors import KVPlaneError
from kvplane.store.client import read_through, replica_io
from kvplane.store.client.context import ClientContext
from kvplane.store.client.location_cache import confirmed
from kvplane.store.client.lookup import lookup, remember
from kvplane.store.client.read_through import get_replicas, resolve
from kvplane.store.client.replica_io import blame, read_items, verified
from kvplane.store.client.timing import MARGIN, coarse, ended_in
from kvplane.store.errors import InvalidParams, key_error
from kvplane.store.types import Columns, KeyResult, Location
from kvplane.transfer.types import TransferStatus

SPECULATED = metrics.Counter(
    "kvplane_store_speculative_reads_total", "Keys a get read from their last known replica while "
    "the master looked them up, by whether the master's answer confirmed the read", ["outcome"])
_CONFIRMED, _REFUTED = SPECULATED.labels("confirmed"), SPECULATED.labels("refuted")
HELD = metrics.Counter(
    "kvplane_store_held_reads_total", "Keys a get read from their known replica under a read "
    "lease this client holds, without a lookup, by outcome (refused: the segment no longer "
    "serves that allocation, or the read failed; the key was then looked up)", ["outcome"])
_HELD_OK, _HELD_REFUSED = HELD.labels("read"), HELD.labels("refused")
_OK, _TIMEOUT = TransferStatus.COMPLETED, TransferStatus.TIMEOUT
log = logging.getLogger(__name__)


def get_into(ctx: ClientContext, keys: list[str], addrs: list[int], caps: list[int],
             deadline: Deadline) -> list[int]:
    """The reads of ``batch_get_into``: per key the bytes read or an error code. Keys with a
    known location are read while the master is asked (module docstring); the others, and
    those the master's answer does not confirm, are read from that answer."""
    spec = _plan(ctx, keys, addrs, caps) if ctx.locations.capacity else None
    if spec is not None and len(spec[0]) == len(keys) and ctx.config.held_reads \
            and not ctx.config.checksum:
        got = _held_read(ctx, keys, spec[1], spec[2], deadline)
        if got is not None:
            return got
    if spec is None:
        return _by_lookup(ctx, keys, addrs, caps, deadline)
    idx, locs, items = spec
    read: list[list[TransferStatus]] = []
    ended: list[float] = []
    # no earlier than the lookup's ``sent``: the lease it grants ends no sooner than this
    # (unless the master's TTL shrank: the check after the answer uses the lease it grants)
    lease_from = time.monotonic()

    def speculate() -> None:  # sent, unless the master could not be asked at all
        # at most half the call's time (a stalled segment leaves the rest to fail over), and
        # ending inside the lease of the lookup it overlaps: the lease that covers it
        left = min(deadline.remaining() / 2, lease_from + ctx.lease_ttl - MARGIN
                   - time.monotonic())
        if left <= 0:
            return
        try:
            read.append(read_items(ctx, items, coarse(left)))
            ended.append(time.monotonic())
        except Exception:
            log.exception("speculative read failed")

    check = ctx.config.checksum
    expect: list[Location | None] | None = None
    if not check:  # confirmed keys need no answer (with checksums on it carries the sums)
        if len(idx) == len(keys):
            expect = cast("list[Location | None]", locs)
        else:
            expect = [None] * len(keys)
            for i, loc in zip(idx, locs):
                expect[i] = loc
    results, lease_end = get_replicas(ctx, keys, deadline, meanwhile=speculate, expect=expect)
    # taken only if the read ended inside the lease this lookup granted: a read that ended
    # later may have read space handed to another object (the key is then read again)
    late = bool(read) and ended[0] >= lease_end
    status = read[0] if read and not late else [TransferStatus.FAILED] * len(items)
    if _TIMEOUT in status:  # tried last, and not speculated on, for a while (suspects.BAD_FOR)
        blame(ctx, {locs[j].segment for j, st in enumerate(status) if st is _TIMEOUT})
    if len(idx) == len(keys) and status.count(_OK) == len(status) \
            and results.count(None) == len(keys):  # all confirmed
        _CONFIRMED.inc(len(keys))
        ctx.locations.hold(keys, locs, lease_end)
        return [loc.size for loc in locs]
    got = [0] * len(keys)
    done = [False] * len(keys)
    for j, i in enumerate(idx):
        r = results[i]
        if status[j] is not _OK:
            continue
        if r is None or not r.code and confirmed(locs[j], r.replicas, r.size) \
                and not (check and not verified(ctx, r, addrs[i])):
            got[i], done[i] = locs[j].size, True
    hits = done.count(True)
    _CONFIRMED.inc(hits)
    if hits:
        ctx.locations.hold([keys[i] for i in idx if done[i]],
                           [loc for j, loc in enumerate(locs) if done[idx[j]]], lease_end)
    # confirmed in place, but the read failed: their replicas, to read them again; after a late
    # read the lookup's lease is over, so every key is looked up again, under a new lease
    again = [i for i in range(len(keys)) if not done[i] and (late or results[i] is None)]
    if again:
        more, until = get_replicas(ctx, [keys[i] for i in again], deadline)
        for i, r in zip(again, more):
            results[i] = r
        lease_end = until if late else min(lease_end, until)
    if hits < len(idx):
        if not late:  # (a late read was not refuted: it ended too late to be taken)
            _REFUTED.inc(len(idx) - hits)
        ctx.locations.forget([keys[i] for i in idx if not done[i] and _found(results[i]).code])
    if hits < len(keys):
        _read_rest(ctx, keys, addrs, caps, deadline, lease_end, results, done, got)
    return got


def _by_lookup(ctx: ClientContext, keys: list[str], addrs: list[int], caps: list[int],
               deadline: Deadline) -> list[int]:
    """:func:`get_into` of keys with no known place: the lookup, then the reads by its answer
    (in one pass when it came as columns)."""
    rep, lease_end = lookup(ctx, keys, deadline, columns=True)
    if rep.columns is not None:
        got = read_columns(ctx, keys, rep.columns, addrs, caps, deadline, lease_end)
        if got is not None:
            return got
    answer = cast("list[KeyResult]", resolve(ctx, keys, rep, deadline))  # (no expect)
    got = read_through.read(ctx, answer, addrs, caps, deadline, lease_end)
    remember(ctx, keys, answer, [i for i, n in enumerate(got) if n >= 0], until=lease_end)
    return got


def _read_rest(ctx: ClientContext, keys: list[str], addrs: list[int], caps: list[int],
               deadline: Deadline, lease_end: float, results: list[KeyResult | None],
               done: list[bool], got: list[int]) -> None:
    """Read the keys not ``done`` by speculation from the master's answer (each answered in
    full by now) into ``got``, and remember where they are."""
    rest = [i for i in range(len(keys)) if not done[i]]
    full = cast("list[KeyResult]", results)
    for i, n in zip(rest, read_through.read(ctx, [full[i] for i in rest],
                                            [addrs[i] for i in rest], [caps[i] for i in rest],
                                            deadline, lease_end)):
        got[i] = n
    remember(ctx, keys, full, [i for i in rest if got[i] >= 0], until=lease_end)


def _found(r: KeyResult | None) -> KeyResult:
    """A key's result once it was answered in full (looked up again if it was confirmed)."""
    assert r is not None
    return r


def _held_read(ctx: ClientContext, keys: list[str], locs: list[Location],
               items: list[tuple[int, int, int, int, int]], deadline: Deadline) -> list[int] | None:
    """Read every key from its held place without a lookup (module docstring); None when
    not every key is held with more than half its lease left, or not every place is served by
    a listener. Keys whose read fails or is refused are looked up and read again."""
    where = ctx.locations
    if ctx.rpc.failovers != where.failovers:  # a new leader: holds of the old one go
        where.drop_holds()
        where.failovers = ctx.rpc.failovers
        return None
    until = where.held_until(keys, locs, ctx.lease_ttl / 2)
    if until is None:
        return None
    listened = ctx.listened
    for h in {it[0] for it in items}:
        ok = listened.get(h)
        if ok is None:
            it = next(it for it in items if it[0] == h)
            ok = listened[h] = ctx.engine.via_listener(h, it[2], it[3])
        if not ok:
            return None
    left = min(deadline.remaining() / 2, until - MARGIN - time.monotonic())
    if left <= 0:
        return None
    status = read_items(ctx, items, coarse(left))
    if not ended_in(until):  # ended after the hold's lease: maybe another object's bytes
        status = [TransferStatus.FAILED] * len(status)
    elif status.count(_OK) == len(status):
        _HELD_OK.inc(len(keys))
        return [loc.size for loc in locs]
    bad = [i for i, st in enumerate(status) if st is not _OK]
    _HELD_OK.inc(len(keys) - len(bad))
    _HELD_REFUSED.inc(len(bad))
    if _TIMEOUT in status:
        blame(ctx, {locs[i].segment for i in bad if status[i] is _TIMEOUT})
    where.forget([keys[i] for i in bad])  # looked up afresh, without speculating
    out = [loc.size for loc in locs]
    again = get_into(ctx, [keys[i] for i in bad], [items[i][1] for i in bad],
                     [items[i][3] for i in bad], deadline)
    for i, n in zip(bad, again):
        out[i] = n
    return out


def held_one(ctx: ClientContext, key: str, addr: int, cap: int, deadline: Deadline) -> int | None:
    """:func:`_held_read` of one key with the least Python: the bytes read, or None (not held
    with more than half its lease left, not served by a listener, or the read failed or was
    refused: its place is then forgotten). The caller then gets it the usual way."""
    where = ctx.locations
    hold = where.holds.get(key)
    if hold is None or ctx.config.checksum or not ctx.config.held_reads \
            or ctx.rpc.failovers != where.failovers:
        return None
    loc, until = hold
    if loc.size > cap:
        return None
    seg = loc.segment
    h = ctx.handles.get(seg)
    if h is None or not ctx.listened.get(h) or (ctx.suspects.any() and ctx.suspects.bad(seg)):
        return None
    left = until - time.monotonic()
    if left <= ctx.lease_ttl / 2 or left <= MARGIN:
        return None
    st = ctx.engine.read_one(h, addr, loc.addr, loc.size, loc.gen,
                             coarse(min(deadline.remaining() / 2, left - MARGIN)))
    if st is _OK:
        if ended_in(until):
            _HELD_OK.inc()
            return loc.size
        st = TransferStatus.FAILED  # ended after the hold's lease: maybe another object's bytes
    _HELD_REFUSED.inc()
    if st is _TIMEOUT:
        blame(ctx, {seg})
    where.forget([key])
    return None


def read_columns(ctx: ClientContext, keys: list[str], cols: Columns, addrs: list[int],
                 caps: list[int], deadline: Deadline, lease_end: float) -> list[int] | None:
    """``replica_io.read_columns``, remembering where the keys read are."""
    got = replica_io.read_columns(ctx, cols, addrs, caps, deadline, lease_end)
    if got is not None and ctx.locations.capacity:
        names = cols.segments
        ctx.locations.put([k for k, n in zip(keys, got) if n >= 0],
                          [Location(names[s], a, g, n) for s, a, g, n in
                           zip(cols.seg, cols.addr, cols.gen, got) if n >= 0], lease_end)
    return got


def sizes(ctx: ClientContext, keys: list[str]) -> list[int] | None:
    """Each key's size where this client last saw it; None unless it knows every key."""
    if not ctx.locations.capacity or not keys:
        return None
    locs = list(map(ctx.locations.known.get, keys))
    if None in locs:
        return None
    return [loc.size for loc in cast("list[Location]", locs)]


def _plan(ctx: ClientContext, keys: list[str], addrs: list[int], caps: list[int]
          ) -> tuple[list[int], list[Location], list[tuple[int, int, int, int, int]]] | None:
    """The keys with a known location on an open segment that no transfer failed on lately,
    and a buffer big enough: their indexes, locations and ``read_many`` items; None if there
    is none."""
    find, handles = ctx.locations.known.get, ctx.handles
    if ctx.suspects.any():
        handles = {s: h for s, h in handles.items() if not ctx.suspects.bad(s)}
    found = list(map(find, keys))
    if None not in found:  # every key known: on one open segment, buffers big enough?
        every = cast("list[Location]", found)
        seg = every[0].segment
        h = handles.get(seg)
        if h is not None and all(loc.segment == seg and loc.size <= c
                                 for loc, c in zip(every, caps)):
            return (list(range(len(keys))), every,
                    [(h, a, loc.addr, loc.size, loc.gen) for a, loc in zip(addrs, every)])
    idx: list[int] = []
    locs: list[Location] = []
    items: list[tuple[int, int, int, int, int]] = []
    for i, loc in enumerate(found):
        if loc is None:
            continue
        h = handles.get(loc.segment)
        if h is None or loc.size > caps[i]:
            continue
        idx.append(i)
        locs.append(loc)
        items.append((h, addrs[i], loc.addr, loc.size, loc.gen))
    return (idx, locs, items) if idx else None


# -- the copying get ------------------------------------------------------------------------------
def get_copies(ctx: ClientContext, keys: list[str], deadline: Deadline
               ) -> list[bytes | KVPlaneError]:
    """``get_batch``: per key its bytes or the exception it failed with. Keys this client knows
    the place of are read while the master looks them up, as by :func:`get_into`; the others
    (and those that grew) by the master's answer."""
    out: list[bytes | KVPlaneError | None] = [None] * len(keys)
    known = sizes(ctx, keys)
    if known is not None:
        got = _staged(ctx, known, lambda addrs: get_into(ctx, keys, addrs, known, deadline))
        for i, v in enumerate(got or ()):
            if isinstance(v, bytes):
                out[i] = v
            elif v != InvalidParams.code:  # (that one grew: read below at its new size)
                out[i] = key_error(v, keys[i])
    rest = [i for i, o in enumerate(out) if o is None]
    if rest:
        for i, o in zip(rest, _by_answer(ctx, [keys[i] for i in rest], deadline)):
            out[i] = o
    return cast("list[bytes | KVPlaneError]", out)


def _by_answer(ctx: ClientContext, keys: list[str], deadline: Deadline
               ) -> list[bytes | KVPlaneError]:
    """:func:`get_copies` by the master's answer: staging sized by it, then the reads."""
    rep, lease_end = lookup(ctx, keys, deadline, columns=True)
    cols = rep.columns
    if cols is not None:
        got = _staged(ctx, cols.size, lambda addrs: read_columns(
            ctx, keys, cols, addrs, cols.size, deadline, lease_end))
        if got is not None:
            return [v if isinstance(v, bytes) else key_error(v, k) for k, v in zip(keys, got)]
    results = cast("list[KeyResult]", resolve(ctx, keys, rep, deadline))  # (no expect)
    hits = [i for i, r in enumerate(results) if r.code == 0]
    out: list[bytes | KVPlaneError] = [key_error(r.code, k) if r.code else b""
                                       for k, r in zip(keys, results)]
    read = _staged(ctx, [results[i].size for i in hits], lambda addrs: read_through.read(
        ctx, [results[i] for i in hits], addrs, [results[i].size for i in hits], deadline,
        lease_end))
    got = read or []  # (``read_through.read`` always answers)
    for i, v in zip(hits, got):
        out[i] = v if isinstance(v, bytes) else key_error(v, keys[i])
    remember(ctx, keys, results, [i for i, v in zip(hits, got) if isinstance(v, bytes)],
             until=lease_end)
    return out


def _staged(ctx: ClientContext, sizes: list[int], read: Callable[[list[int]], list[int] | None]
            ) -> list[bytes | int] | None:
    """``read`` into staging blocks of ``sizes``: per key its bytes, or the error code
    ``read`` gave it; None if ``read`` did."""
    with ExitStack() as stack:
        blocks = [stack.enter_context(ctx.staging.block(n)) for n in sizes]
        got = read([a for a, _ in blocks])
        if got is None:
            return None
        return [view[:n].tobytes() if n >= 0 else n for n, (_, view) in zip(got, blocks)]
