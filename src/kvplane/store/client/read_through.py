"""The client's side of the SSD tier on reads: disk-only objects are brought into memory.

* **Read-through**: GetReplicaList answers an object that is only on disk with no memory
  replica and its disk copies (``KeyResult.disk``). The client asks the owner of the copy to
  bring it into memory (``load`` on the owner's disk RPC: the owner promotes it into its own
  segment, ``kvplane.store.host.disk_node``), then asks the master again and reads the new memory
  replica as usual. All of it draws on the call's one deadline.

``resolve`` is a lookup's answer made whole (``lookup.expand``, then read-through), and
``get_replicas`` a lookup and that: what the get path reads from. Imports ``context``,
``replica_io`` and ``lookup``; never binds sockets itself (the disk links are the context's).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import cast

from kvplane.common.deadline import Deadline
from kvplane.common.errors import KVPlaneError
from kvplane.store.checksum import digest
from kvplane.store.client import replica_io
from kvplane.store.client.context import ClientContext
from kvplane.store.client.lookup import expand, lookup
from kvplane.store.client.timing import coarse
from kvplane.store.errors import ChecksumMismatch, InvalidParams, ObjectNotFound, TransferFail
from kvplane.store.tier_types import LoadRep, LoadReq
from kvplane.store.types import KeyResult, KeysReq, Location, ResultsRep

ROUNDS = 4  # load + re-ask rounds for one get
BUSY_PAUSE = 0.005  # seconds before asking again when another reader is promoting the object


class Served(KeyResult, array_like=True):
    """A hit whose value a disk node sent back with its read-through reply."""

    data: bytes = b""


def cold(results: Sequence[KeyResult | None]) -> list[int]:
    """Indices of hits that are on disk only (and not served yet; None: confirmed in place)."""
    return [i for i, r in enumerate(results)
            if r is not None and r.code == 0 and not r.replicas and r.disk
            and not isinstance(r, Served)]


def read(ctx: ClientContext, results: list[KeyResult], addrs: list[int], sizes: list[int],
         deadline: Deadline, lease_end: float) -> list[int]:
    """``replica_io.read``, with the values disk nodes served inline copied into place."""
    served = [i for i, r in enumerate(results) if isinstance(r, Served)]
    if not served:
        return replica_io.read(ctx, results, addrs, sizes, deadline, lease_end)
    rest = [i for i in range(len(results)) if not isinstance(results[i], Served)]
    got = [0] * len(results)
    for i, n in zip(rest, replica_io.read(ctx, [results[i] for i in rest],
                                          [addrs[i] for i in rest], [sizes[i] for i in rest],
                                          deadline, lease_end)):
        got[i] = n
    for i in served:
        data = cast(Served, results[i]).data
        if len(data) > sizes[i]:
            got[i] = InvalidParams.code
            continue
        ctx.engine.memory.view(addrs[i], len(data))[:] = data
        got[i] = len(data)
    return got


def read_through(ctx: ClientContext, keys: list[str], given: Sequence[KeyResult | None],
                 deadline: Deadline, inline: bool = True) -> list[KeyResult | None]:
    """Serve the disk-only objects among ``given``: ``Served`` with their bytes, or fresh
    results with memory replicas once promoted (always the latter when not ``inline``)."""
    results = list(given)
    failed: dict[int, int] = {}
    for _ in range(ROUNDS):
        todo = [i for i in cold(results) if i not in failed]
        if not todo or deadline.expired():
            break
        codes, data = _load(ctx, [keys[i] for i in todo], [_hit(results[i]) for i in todo],
                            deadline, inline)
        for j, i in enumerate(todo):
            if codes[j] < 0:
                failed[i] = codes[j]
                continue
            value = data[j]
            if value is not None:
                r = _hit(results[i])
                results[i] = Served(r.code, [], r.size, r.version, r.checksum, b"", r.disk,
                                    value)
        again = [i for i in todo if i not in failed and not isinstance(results[i], Served)]
        if not again:
            break
        rep = ctx.call("get_replicas", KeysReq(ctx.config.client_id, [keys[i] for i in again],
                                               ctx.suspects.take()), ResultsRep, deadline)
        for i, r in zip(again, rep.results):
            results[i] = r
        if cold([results[i] for i in again]):
            time.sleep(min(BUSY_PAUSE, max(0.0, deadline.remaining())))
    for i in cold(results):
        code = failed.get(i, TransferFail.code)
        results[i] = KeyResult(ObjectNotFound.code if code == ObjectNotFound.code
                               else TransferFail.code)
    return results


def _hit(r: KeyResult | None) -> KeyResult:
    """A cold key's result (``cold`` never names a confirmed key's None)."""
    assert r is not None
    return r


def _load(ctx: ClientContext, keys: list[str], results: list[KeyResult],
          deadline: Deadline, inline: bool) -> tuple[list[int], list[bytes | None]]:
    """Ask each owner for its objects; per index a code (< 0 failed) and the value when the
    owner sent it inline."""
    by_endpoint: dict[str, list[int]] = {}
    for i, r in enumerate(results):
        by_endpoint.setdefault(r.disk[0].endpoint, []).append(i)
    codes = [0] * len(results)
    data: list[bytes | None] = [None] * len(results)
    for endpoint, idx in by_endpoint.items():
        try:
            rep = ctx.disk_links.get(endpoint).call(
                "load", LoadReq([results[i].disk[0].key or keys[i] for i in idx],
                                [results[i].version for i in idx], inline,
                                [results[i].disk[0].ticket for i in idx]),
                LoadRep, timeout=coarse(deadline.check("disk read-through")))
        except KVPlaneError:
            ctx.suspects.add([results[i].disk[0].segment for i in idx])
            for i in idx:
                codes[i] = TransferFail.code
            continue
        for j, i in enumerate(idx):
            codes[i] = rep.codes[j]
            if rep.codes[j] == 0 and j < len(rep.data) and rep.data[j]:
                if len(rep.data[j]) == results[i].size and \
                        digest(rep.data[j]) == results[i].checksum:
                    data[i] = rep.data[j]
                else:
                    codes[i] = ChecksumMismatch.code
    return codes, data


def resolve(ctx: ClientContext, keys: list[str], rep: ResultsRep,
            deadline: Deadline) -> list[KeyResult | None]:
    """Per key the result in ``rep`` (None for a key confirmed where it was expected), with
    the objects that are on disk only served first."""
    results = expand(keys, rep)
    if cold(results):  # on disk only: the owner reads them into memory first
        return read_through(ctx, list(keys), results, deadline)
    return results


def get_replicas(ctx: ClientContext, keys: list[str], deadline: Deadline,
                 meanwhile: Callable[[], None] | None = None,
                 expect: list[Location | None] | None = None
                 ) -> tuple[list[KeyResult | None], float]:
    """The replicas and the local time their read lease ends (``lookup.lookup``); with
    ``expect``, None for the keys the master confirmed."""
    rep, lease_end = lookup(ctx, keys, deadline, meanwhile, expect)
    return resolve(ctx, keys, rep, deadline), lease_end
