"""Byte-range reads and writes of stored objects: the core of Mooncake's ``get_into_ranges``
and its get/put sessions (layer-wise KV: one master round trip, then many range transfers).

* ``lookup(keys)`` asks for the replicas once (a read lease, as any get); ``read(result,
  ranges)`` then moves ``[src, src+size)`` of the object into registered memory for each range,
  trying the replicas in order (same host first) and failing a range over to the next replica.
  A range outside the object is INVALID_PARAMS; a read is given until just before the lease
  ends, and ranges whose read ended after the lease did fail with LEASE_EXPIRED (the space may
  hold another object by then).
* ``reserve(keys, sizes, cfg)`` is a PutStart; ``write(result, ranges)`` copies ranges into every
  replica; ``commit``/``revoke`` are PutEnd/PutRevoke with each put's version. Frames carry
  the allocation's generation, so a segment that fenced it refuses them.

Results are per range: bytes moved, or a negative store code. Calls that reach the master
raise from the kvplane tree when it cannot be reached. Built from a client's context (``Ranges(client)``
takes anything with a ``context``); imports the engine, store types, and the client's ``context``,
``timing`` and ``read_through`` layers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import cast

from kvplane.common.deadline import Deadline
from kvplane.common.errors import KVPlaneError
from kvplane.store.client.context import ContextOwner
from kvplane.store.client.read_through import cold, read_through
from kvplane.store.client.timing import MARGIN, ended_in
from kvplane.store.errors import InvalidParams, LeaseExpired, TransferFail
from kvplane.store.types import (
    CodesRep,
    KeyResult,
    KeysReq,
    PutEndReq,
    PutStartReq,
    Replica,
    ReplicateConfig,
    ResultsRep,
)
from kvplane.transfer import OpCode, TransferRequest, TransferStatus

Range = tuple[int, int, int]  # (object offset, local address, size)


class Ranges:
    """Range transfers for one client (thread-safe; no state beyond a segment-handle cache)."""

    def __init__(self, client: ContextOwner) -> None:
        self.c = client.context
        self._handles: dict[str, int] = {}

    # -- reads ----------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[str]) -> tuple[list[KeyResult], float]:
        """(replicas per key, monotonic time the read leases end)."""
        t0 = time.monotonic()
        rep = self.c.rpc.call("get_replicas", KeysReq(self.c.config.client_id, list(keys)),
                              ResultsRep)
        if rep.grants:  # a tenant's: before reading there
            self.c.install_grants(rep.grants, Deadline.after(self.c.config.timeout))
        ttl = rep.ttl or self.c.config.lease_ttl  # the master's lease, as it states it
        results = rep.results
        if cold(results):  # on an SSD tier only: promoted into memory first (never None:
            results = cast("list[KeyResult]", read_through(  # no ``expect`` was sent)
                self.c, list(keys), results, Deadline.after(self.c.config.timeout), inline=False))
        return results, t0 + ttl

    def read(self, result: KeyResult, ranges: Sequence[Range], lease_end: float) -> list[int]:
        """Read each range of one object (see the module docstring)."""
        return self._each(result, ranges, OpCode.READ, lease_end, first_only=True)

    # -- writes ---------------------------------------------------------------------------------
    def reserve(self, keys: Sequence[str], sizes: Sequence[int],
                cfg: ReplicateConfig | None) -> list[KeyResult]:
        """PutStart: per key its replicas (invisible until ``commit``) or a code."""
        rep = self.c.rpc.call("put_start", PutStartReq(
            self.c.config.client_id, list(keys), [int(s) for s in sizes],
            cfg or ReplicateConfig()), ResultsRep)
        if rep.grants:  # a tenant's: before writing there
            self.c.install_grants(rep.grants, Deadline.after(self.c.config.timeout))
        return rep.results

    def write(self, result: KeyResult, ranges: Sequence[Range]) -> list[int]:
        """Write each range into every replica of a reserved object."""
        return self._each(result, ranges, OpCode.WRITE, float("inf"), first_only=False)

    def commit(self, results: Sequence[tuple[str, KeyResult]]) -> list[int]:
        """PutEnd of reserved objects, each with the version its PutStart gave. No checksum is
        recorded (the bytes arrived range by range): reads of these objects are not verified."""
        return self.c.rpc.call("put_end", PutEndReq(
            self.c.config.client_id, [k for k, _ in results], [r.version for _, r in results]),
            CodesRep).codes

    def revoke(self, results: Sequence[tuple[str, KeyResult]]) -> list[int]:
        return self.c.rpc.call("put_revoke", PutEndReq(
            self.c.config.client_id, [k for k, _ in results], [r.version for _, r in results]),
            CodesRep).codes

    # -- transfers --------------------------------------------------------------------------------
    def _each(self, result: KeyResult, ranges: Sequence[Range], op: OpCode, lease_end: float,
              first_only: bool) -> list[int]:
        out = [0] * len(ranges)
        todo = []
        for i, (off, _addr, size) in enumerate(ranges):
            if off < 0 or size < 0 or off + size > result.size:
                out[i] = InvalidParams.code
            elif size == 0:
                out[i] = 0
            else:
                todo.append(i)
        if not todo:
            return out
        mine = self.c.engine.host_id
        replicas = sorted(result.replicas, key=lambda r: r.host_id != mine)
        if first_only:
            left = list(todo)
            for rep in replicas:
                if not left or time.monotonic() >= lease_end - MARGIN:
                    break
                done = self._move(rep, op, [ranges[i] for i in left], lease_end)
                if not ended_in(lease_end):  # read too late: maybe another object's
                    break  # bytes (``left`` then fails with LEASE_EXPIRED)
                left = [i for i, ok in zip(left, done) if not ok]
            for i in todo:
                out[i] = ranges[i][2] if i not in left else (
                    LeaseExpired.code if time.monotonic() >= lease_end - MARGIN
                    else TransferFail.code)
            return out
        oks = [self._move(rep, op, [ranges[i] for i in todo]) for rep in replicas]
        for j, i in enumerate(todo):
            out[i] = ranges[i][2] if oks and all(ok[j] for ok in oks) else TransferFail.code
        return out

    def _move(self, rep: Replica, op: OpCode, ranges: Sequence[Range],
              lease_end: float = float("inf")) -> list[bool]:
        """Move ``ranges`` to or from one replica; a read is given until ``MARGIN``
        before its lease ends (``lease_end``), at most the client's timeout."""
        timeout = min(self.c.config.timeout, lease_end - MARGIN - time.monotonic())
        if timeout <= 0:
            return [False] * len(ranges)
        try:
            handle = self._handles.get(rep.segment)
            if handle is None:
                handle = self.c.engine.open_segment(rep.segment, timeout=min(timeout, 5.0))
                self._handles[rep.segment] = handle
            reqs = [TransferRequest(op, addr, handle, rep.addr + off, size, gen=rep.gen)
                    for off, addr, size in ranges]
            statuses = self.c.engine.transfer(reqs, timeout)
        except KVPlaneError:
            self._handles.pop(rep.segment, None)
            return [False] * len(ranges)
        ok = [s == TransferStatus.COMPLETED for s in statuses]
        if not all(ok):
            self._handles.pop(rep.segment, None)
        return ok
