"""The client's side of the SSD tier: read-through of disk-only objects, and puts that wait
for offloads.

* **Read-through**: GetReplicaList answers an object that is only on disk with no memory
  replica and its disk copies (``KeyResult.disk``). The client asks the owner of the copy to
  bring it into memory (``load`` on the owner's disk RPC: the owner promotes it into its own
  segment, ``kvplane.store.disk.node``), then asks the master again and reads the new memory
  replica as usual. All of it draws on the call's one deadline.
* **Backpressure**: when the pool is full of objects whose disk copies are still being
  written, PutStart answers NoAvailableHandle with ``retry_after``; the client retries those
  keys after that pause while its deadline lasts, instead of failing at once.

Imports the common RPC client and store types; never binds sockets itself.
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import TYPE_CHECKING

from kvplane.common.deadline import Deadline
from kvplane.common.errors import KVPlaneError
from kvplane.common.rpc import RpcClient
from kvplane.store.client import moves
from kvplane.store.checksum import digest
from kvplane.store.errors import (
    ChecksumMismatch, InvalidParams, NoAvailableHandle, ObjectNotFound, TransferFail,
)
from kvplane.store.tier_types import LoadRep, LoadReq
from kvplane.store.types import KeyResult, KeysReq, PutStartReq, ReplicateConfig, ResultsRep

if TYPE_CHECKING:
    from kvplane.store.client.client import StoreClient

ROUNDS = 4  # load + re-ask rounds for one get
BUSY_PAUSE = 0.005  # seconds before asking again when another reader is promoting the object


class Served(KeyResult, array_like=True):
    """A hit whose value a disk node sent back with its read-through reply."""

    data: bytes = b""


class DiskLinks:
    """RPC connections to the disk endpoints of other nodes (one per endpoint)."""

    def __init__(self, token: str) -> None:
        self._token = token
        self._lock = threading.Lock()
        self._links: dict[str, RpcClient] = {}

    def get(self, endpoint: str) -> RpcClient:
        with self._lock:
            link = self._links.get(endpoint)
            if link is None:
                link = self._links[endpoint] = RpcClient(endpoint, self._token)
            return link

    def close(self) -> None:
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()


def cold(results: list[KeyResult]) -> list[int]:
    """Indices of hits that are on disk only (and not served yet; None: confirmed in place)."""
    return [i for i, r in enumerate(results)
            if r is not None and r.code == 0 and not r.replicas and r.disk and not isinstance(r, Served)]


def read(client: "StoreClient", results: list[KeyResult], addrs: list[int], sizes: list[int],
         deadline: Deadline, lease_end: float) -> list[int]:
    """``moves.read``, with the values disk nodes served inline copied into place."""
    served = [i for i, r in enumerate(results) if isinstance(r, Served)]
    if not served:
        return moves.read(client, results, addrs, sizes, deadline, lease_end)
    rest = [i for i in range(len(results)) if not isinstance(results[i], Served)]
    got = [0] * len(results)
    for i, n in zip(rest, moves.read(client, [results[i] for i in rest], [addrs[i] for i in rest],
                                     [sizes[i] for i in rest], deadline, lease_end)):
        got[i] = n
    for i in served:
        data = results[i].data  # type: ignore[attr-defined]
        if len(data) > sizes[i]:
            got[i] = InvalidParams.code
            continue
        client.engine.memory.view(addrs[i], len(data))[:] = data
        got[i] = len(data)
    return got


def read_through(client: "StoreClient", keys: list[str], results: list[KeyResult],
                 deadline: Deadline, inline: bool = True) -> list[KeyResult]:
    """Serve the disk-only objects among ``results``: ``Served`` with their bytes, or fresh
    results with memory replicas once promoted (always the latter when not ``inline``)."""
    results = list(results)
    failed: dict[int, int] = {}
    for _ in range(ROUNDS):
        todo = [i for i in cold(results) if i not in failed]
        if not todo or deadline.expired():
            break
        codes, data = _load(client, [keys[i] for i in todo], [results[i] for i in todo], deadline,
                            inline)
        for j, i in enumerate(todo):
            if codes[j] < 0:
                failed[i] = codes[j]
            elif data[j] is not None:
                r = results[i]
                results[i] = Served(r.code, [], r.size, r.version, r.checksum, b"", r.disk,
                                    data[j])
        again = [i for i in todo if i not in failed and not isinstance(results[i], Served)]
        if not again:
            break
        rep = client._call("get_replicas", KeysReq(client.config.client_id,
                                                   [keys[i] for i in again],
                                                   client.suspects.take()), ResultsRep, deadline)
        for i, r in zip(again, rep.results):
            results[i] = r
        if cold([results[i] for i in again]):
            time.sleep(min(BUSY_PAUSE, max(0.0, deadline.remaining())))
    for i in cold(results):
        code = failed.get(i, TransferFail.code)
        results[i] = KeyResult(ObjectNotFound.code if code == ObjectNotFound.code
                               else TransferFail.code)
    return results


def _load(client: "StoreClient", keys: list[str], results: list[KeyResult],
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
            rep = client.disk_links.get(endpoint).call(
                "load", LoadReq([results[i].disk[0].key or keys[i] for i in idx],
                                [results[i].version for i in idx], inline,
                                [results[i].disk[0].ticket for i in idx]),
                LoadRep, timeout=moves.coarse(deadline.check("disk read-through")))
        except KVPlaneError:
            client.suspects.add([results[i].disk[0].segment for i in idx])
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


def put_start(client: "StoreClient", keys: list[str], sizes: list[int], cfg: ReplicateConfig,
              upsert: bool, sums: list[int], deadline: Deadline) -> ResultsRep:
    """PutStart, retrying keys the master could not place yet while offloads make room."""
    rep = client._call("put_start", PutStartReq(
        client.config.client_id, keys, sizes, cfg, upsert, deadline.remaining(), sums,
        secrets.randbits(63) | 1, client.retired.take(), client.spares.returns()), ResultsRep,
        deadline)
    while rep.retry_after > 0:
        full = [i for i, r in enumerate(rep.results) if r.code == NoAvailableHandle.code]
        if not full or deadline.remaining() <= rep.retry_after + 0.5:
            break
        time.sleep(rep.retry_after)
        again = client._call("put_start", PutStartReq(
            client.config.client_id, [keys[i] for i in full], [sizes[i] for i in full], cfg,
            upsert, deadline.remaining(), [sums[i] for i in full], secrets.randbits(63) | 1),
            ResultsRep, deadline)
        results = list(rep.results)
        for i, r in zip(full, again.results):
            results[i] = r
        retire = (rep.retire or []) + [(full[j], s, g) for j, s, g in again.retire or []]
        rep = ResultsRep(results, again.ttl, again.retry_after, retire=retire or None)
    return rep
