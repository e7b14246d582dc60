"""Where this client last saw each object: the read it speculates on while the master answers.

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
earlier hold may have ended before the read began). The read is given until ``moves.MARGIN``
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
out is suspect (``moves.blame``): no speculation on it while it is.

The cache is a bounded dict in insertion order (``StoreConfig.location_cache`` keys; 0 turns
speculation off). Entries come from gets and from this client's committed puts, and go with its
removes.

**Held reads.** A lookup grants a read lease (the master's ``lease_ttl``, 10 s). While it runs
the master neither evicts the object nor removes it without ``force``, nor hands its space to
another object (``fences.Quarantine``), so the place holds the key's value. A key whose place
this client learned or had confirmed by such a lookup is *held* until the lease ends (counted
from before the lookup was sent). A get of keys that are all held, with more than half of
their lease left, reads them without asking the master at all: one round trip (given until
``moves.MARGIN`` before the hold's lease ends; one that returns after it ended is not taken,
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
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvplane.common import metrics
from kvplane.common.deadline import Deadline
from kvplane.store.client import moves, tiering
from kvplane.store.types import Columns, KeyResult, Location, Replica
from kvplane.transfer.types import TransferStatus

if TYPE_CHECKING:
    from kvplane.store.client.client import StoreClient

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


class Locations:
    """At most ``capacity`` keys' last known replica; the oldest entries go first. A key may
    also be *held*: the place a lookup named or confirmed, with the local time that lookup's
    read lease ends. A hold is of that place only: a newer place of the key (this client's own
    put) is not held by it."""

    __slots__ = ("capacity", "_map", "_held", "_lock", "failovers")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._map: dict[str, Location] = {}
        self._held: dict[str, tuple[Location, float]] = {}  # key -> (place, its lease end)
        self._lock = threading.Lock()  # mutations (a lookup is one dict operation)
        self.failovers = 0  # the master link's leader changes when the holds were granted

    def __len__(self) -> int:
        return len(self._map)

    def get(self, key: str) -> Location | None:
        return self._map.get(key)

    def learn(self, keys: Iterable[str], replicas: Iterable[Replica], sizes: Iterable[int],
              until: float | None = None) -> None:
        """Remember that each key's object (of that size) is at that replica."""
        self.put(keys, [(r.segment, r.addr, r.gen, n) for r, n in zip(replicas, sizes)], until)

    def put(self, keys: Iterable[str], locs: list[Location], until: float | None = None) -> None:
        """Remember each key's location; ``until``: the local time the read lease of the
        lookup that named it ends (None: no lease, e.g. this client's own put)."""
        m, held = self._map, self._held
        keys = list(keys)
        with self._lock:
            m.update(zip(keys, locs))
            if until is not None:
                held.update(zip(keys, [(loc, until) for loc in locs]))
            elif held:
                for k in keys:
                    held.pop(k, None)
            over = len(m) - self.capacity
            if over > 0:
                for k in list(itertools.islice(m, over)):
                    del m[k]
                    held.pop(k, None)

    def hold(self, keys: Iterable[str], locs: Iterable[Location], until: float) -> None:
        """A lookup that granted a lease until ``until`` confirmed that each key is at that
        place: held, unless the key has moved on since (or was forgotten)."""
        m, held = self._map, self._held
        with self._lock:
            for k, loc in zip(keys, locs):
                if m.get(k) == loc:
                    held[k] = (loc, until)

    def held(self, key: str) -> tuple[Location, float] | None:
        """The place ``key`` is held at and the local time its lease ends, or None."""
        return self._held.get(key)

    def held_until(self, keys: list[str], locs: list[Location], fresh: float) -> float | None:
        """The earliest lease end of ``keys`` when every one is held at its place in ``locs``
        for at least ``fresh`` more seconds, else None."""
        held = self._held
        if not held:
            return None
        until = float("inf")
        for k, loc in zip(keys, locs):
            h = held.get(k)
            if h is None or h[0] != loc:
                return None
            if h[1] < until:
                until = h[1]
        return until if until - time.monotonic() > fresh else None

    def drop_holds(self) -> None:
        """Forget every hold (the master restarted or the leader changed)."""
        with self._lock:
            self._held.clear()

    def forget(self, keys: Iterable[str]) -> None:
        m, held = self._map, self._held
        with self._lock:
            for k in keys:
                m.pop(k, None)
                held.pop(k, None)

    def clear(self) -> None:
        with self._lock:
            self._map.clear()
            self._held.clear()


def confirmed(loc: Location, replicas: list[Replica], size: int) -> bool:
    """True if the master's ``replicas`` (and ``size``) for a key include the allocation at
    ``loc``: the bytes read from there are the key's object."""
    seg, addr, gen, n = loc
    if n != size:
        return False
    for r in replicas:
        if r.gen == gen and r.addr == addr and r.segment == seg:
            return True
    return False


def get_into(client: "StoreClient", keys: list[str], addrs: list[int], caps: list[int],
             deadline: Deadline) -> list[int]:
    """The reads of ``batch_get_into``: per key the bytes read or an error code. Keys with a
    known location are read while the master is asked (module docstring); the others, and
    those the master's answer does not confirm, are read from that answer."""
    spec = _plan(client, keys, addrs, caps) if client.locations.capacity else None
    if spec is not None and len(spec[0]) == len(keys) and client.config.held_reads \
            and not client.config.checksum:
        got = _held_read(client, keys, spec[1], spec[2], deadline)
        if got is not None:
            return got
    if spec is None:
        rep, lease_end = client._lookup(keys, deadline, columns=True)
        if rep.columns is not None:
            got = read_columns(client, keys, rep.columns, addrs, caps, deadline, lease_end)
            if got is not None:
                return got
        results = client._results(keys, rep, deadline)
        got = tiering.read(client, results, addrs, caps, deadline, lease_end)
        remember(client, keys, results, [i for i, n in enumerate(got) if n >= 0],
                 until=lease_end)
        return got
    idx, locs, items = spec
    read: list[list[TransferStatus]] = []
    ended: list[float] = []
    # no earlier than the lookup's ``sent``: the lease it grants ends no sooner than this
    # (unless the master's TTL shrank: the check after the answer uses the lease it grants)
    lease_from = time.monotonic()

    def speculate() -> None:  # sent, unless the master could not be asked at all
        # at most half the call's time (a stalled segment leaves the rest to fail over), and
        # ending inside the lease of the lookup it overlaps: the lease that covers it
        left = min(deadline.remaining() / 2, lease_from + client.lease_ttl - moves.MARGIN
                   - time.monotonic())
        if left <= 0:
            return
        try:
            read.append(client.engine.read_many(items, moves.coarse(left)))
            ended.append(time.monotonic())
        except Exception:  # noqa: BLE001 - a failed speculation is a read to do again
            log.exception("speculative read failed")

    check = client.config.checksum
    expect: list[Location | None] | None = None
    if not check:  # confirmed keys need no answer (with checksums on it carries the sums)
        if len(idx) == len(keys):
            expect = locs  # type: ignore[assignment]
        else:
            expect = [None] * len(keys)
            for i, loc in zip(idx, locs):
                expect[i] = loc
    results, lease_end = client._get_replicas(keys, deadline, meanwhile=speculate, expect=expect)
    # taken only if the read ended inside the lease this lookup granted: a read that ended
    # later may have read space handed to another object (the key is then read again)
    late = bool(read) and ended[0] >= lease_end
    status = read[0] if read and not late else [TransferStatus.FAILED] * len(items)
    if _TIMEOUT in status:  # tried last, and not speculated on, for a while (moves.BAD_FOR)
        moves.blame(client, {locs[j][0] for j, st in enumerate(status) if st is _TIMEOUT})
    if len(idx) == len(keys) and status.count(_OK) == len(status) \
            and results.count(None) == len(keys):  # type: ignore[arg-type] # all confirmed
        _CONFIRMED.inc(len(keys))
        client.locations.hold(keys, locs, lease_end)
        return [loc[3] for loc in locs]
    got = [0] * len(keys)
    done = [False] * len(keys)
    for j, i in enumerate(idx):
        r = results[i]
        if status[j] is not _OK:
            continue
        if r is None or not r.code and confirmed(locs[j], r.replicas, r.size) \
                and not (check and not moves.verified(client, r, addrs[i])):
            got[i], done[i] = locs[j][3], True
    hits = done.count(True)
    _CONFIRMED.inc(hits)
    if hits:
        client.locations.hold([keys[i] for i in idx if done[i]],
                              [loc for j, loc in enumerate(locs) if done[idx[j]]], lease_end)
    # confirmed in place, but the read failed: their replicas, to read them again; after a late
    # read the lookup's lease is over, so every key is looked up again, under a new lease
    again = [i for i in range(len(keys)) if not done[i] and (late or results[i] is None)]
    if again:
        more, until = client._get_replicas([keys[i] for i in again], deadline)
        for i, r in zip(again, more):
            results[i] = r
        lease_end = until if late else min(lease_end, until)
    if hits < len(idx):
        if not late:  # (a late read was not refuted: it ended too late to be taken)
            _REFUTED.inc(len(idx) - hits)
        client.locations.forget([keys[i] for i in idx if not done[i] and results[i].code])
    if hits == len(keys):
        return got
    rest = [i for i in range(len(keys)) if not done[i]]
    for i, n in zip(rest, tiering.read(client, [results[i] for i in rest], [addrs[i] for i in rest],
                                       [caps[i] for i in rest], deadline, lease_end)):
        got[i] = n
    remember(client, keys, results, [i for i in rest if got[i] >= 0], until=lease_end)
    return got


def _held_read(client: "StoreClient", keys: list[str], locs: list[Location],
               items: list[tuple[int, int, int, int, int]], deadline: Deadline) -> list[int] | None:
    """Read every key from its held place without a lookup (module docstring); None when
    not every key is held with more than half its lease left, or not every place is served by
    a listener. Keys whose read fails or is refused are looked up and read again."""
    where = client.locations
    if client.rpc.failovers != where.failovers:  # a new leader: holds of the old one go
        where.drop_holds()
        where.failovers = client.rpc.failovers
        return None
    until = where.held_until(keys, locs, client.lease_ttl / 2)
    if until is None:
        return None
    listened = client._listened
    for h in {it[0] for it in items}:
        ok = listened.get(h)
        if ok is None:
            it = next(it for it in items if it[0] == h)
            ok = listened[h] = client.engine.via_listener(h, it[2], it[3])
        if not ok:
            return None
    left = min(deadline.remaining() / 2, until - moves.MARGIN - time.monotonic())
    if left <= 0:
        return None
    status = client.engine.read_many(items, moves.coarse(left))
    if not moves.ended_in(until):  # ended after the hold's lease: maybe another object's bytes
        status = [TransferStatus.FAILED] * len(status)
    elif status.count(_OK) == len(status):
        _HELD_OK.inc(len(keys))
        return [loc[3] for loc in locs]
    bad = [i for i, st in enumerate(status) if st is not _OK]
    _HELD_OK.inc(len(keys) - len(bad))
    _HELD_REFUSED.inc(len(bad))
    if _TIMEOUT in status:
        moves.blame(client, {locs[i][0] for i in bad if status[i] is _TIMEOUT})
    where.forget([keys[i] for i in bad])  # looked up afresh, without speculating
    out = [loc[3] for loc in locs]
    again = get_into(client, [keys[i] for i in bad], [items[i][1] for i in bad],
                     [items[i][3] for i in bad], deadline)
    for i, n in zip(bad, again):
        out[i] = n
    return out


def held_one(client: "StoreClient", key: str, addr: int, cap: int, deadline: Deadline) -> int | None:
    """:func:`_held_read` of one key with the least Python: the bytes read, or None (not held
    with more than half its lease left, not served by a listener, or the read failed or was
    refused: its place is then forgotten). The caller then gets it the usual way."""
    where = client.locations
    h = where._held.get(key)
    if h is None or client.config.checksum or not client.config.held_reads \
            or client.rpc.failovers != where.failovers:
        return None
    loc, until = h
    if loc[3] > cap:
        return None
    seg = loc[0]
    h = client._handles.get(seg)
    if h is None or not client._listened.get(h) or (client.suspects.any() and client.suspects.bad(seg)):
        return None
    left = until - time.monotonic()
    if left <= client.lease_ttl / 2 or left <= moves.MARGIN:
        return None
    st = client.engine.read_one(h, addr, loc[1], loc[3], loc[2],
                                moves.coarse(min(deadline.remaining() / 2, left - moves.MARGIN)))
    if st is _OK:
        if moves.ended_in(until):
            _HELD_OK.inc()
            return loc[3]
        st = TransferStatus.FAILED  # ended after the hold's lease: maybe another object's bytes
    _HELD_REFUSED.inc()
    if st is _TIMEOUT:
        moves.blame(client, {seg})
    where.forget([key])
    return None


def read_columns(client: "StoreClient", keys: list[str], cols: Columns, addrs: list[int],
                 caps: list[int], deadline: Deadline, lease_end: float) -> list[int] | None:
    """``moves.read_columns``, remembering where the keys read are."""
    got = moves.read_columns(client, cols, addrs, caps, deadline, lease_end)
    if got is not None and client.locations.capacity:
        names = cols.segments
        client.locations.put([k for k, n in zip(keys, got) if n >= 0],
                             [(names[s], a, g, n) for s, a, g, n in
                              zip(cols.seg, cols.addr, cols.gen, got) if n >= 0], lease_end)
    return got


def sizes(client: "StoreClient", keys: list[str]) -> list[int] | None:
    """Each key's size where this client last saw it; None unless it knows every key."""
    if not client.locations.capacity or not keys:
        return None
    locs = list(map(client.locations._map.get, keys))
    return None if None in locs else [loc[3] for loc in locs]  # type: ignore[index]


def _plan(client: "StoreClient", keys: list[str], addrs: list[int], caps: list[int]
          ) -> tuple[list[int], list[Location], list[tuple[int, int, int, int, int]]] | None:
    """The keys with a known location on an open segment that no transfer failed on lately,
    and a buffer big enough: their indexes, locations and ``read_many`` items; None if there
    is none."""
    find, handles = client.locations._map.get, client._handles
    if client.suspects.any():
        handles = {s: h for s, h in handles.items() if not client.suspects.bad(s)}
    locs = list(map(find, keys))
    if None not in locs:  # every key known: on one open segment, buffers big enough?
        seg = locs[0][0]  # type: ignore[index]
        h = handles.get(seg)
        if h is not None and all(loc[0] == seg and loc[3] <= c  # type: ignore[index]
                                 for loc, c in zip(locs, caps)):
            return (list(range(len(keys))), locs,  # type: ignore[return-value]
                    [(h, a, loc[1], loc[3], loc[2]) for a, loc in zip(addrs, locs)])  # type: ignore[index]
    idx: list[int] = []
    locs: list[Location] = []
    items: list[tuple[int, int, int, int, int]] = []
    for i, k in enumerate(keys):
        loc = find(k)
        if loc is None:
            continue
        h = handles.get(loc[0])
        if h is None or loc[3] > caps[i]:
            continue
        idx.append(i)
        locs.append(loc)
        items.append((h, addrs[i], loc[1], loc[3], loc[2]))
    return (idx, locs, items) if idx else None


def remember(client: "StoreClient", keys: list[str], results: list[KeyResult], which: list[int],
             sizes: list[int] | None = None, until: float | None = None) -> None:
    """Remember where the found keys among ``which`` are: the replica a read tries first (same
    host first). ``sizes``: the objects' sizes when ``results`` do not carry them (a put's);
    ``until``: the local end of the read lease the lookup granted (None: none, a put)."""
    if not client.locations.capacity:
        return
    found = [i for i in which if not results[i].code and results[i].replicas]
    if found:
        client.locations.learn([keys[i] for i in found],
                               [moves.ordered(client, results[i].replicas)[0] for i in found],
                               [results[i].size if sizes is None else sizes[i] for i in found],
                               until)
