"""The master's side of data-plane grants: what a tenant may touch at each segment.

A tenant's lookup, PutStart and remove answers carry, for every memory replica they name (and
every generation the caller must retire), a grant (``kvplane.transfer.grants``) bound to the
tenant's identity and keyed for that replica's segment: READ on the value until the object's
read lease ends (lookup), WRITE (and READ) on the header and value until the put's write
window ends (PutStart), RETIRE of a replaced generation. Expiries are wall-clock milliseconds,
as the segments compare them (hosts must keep their clocks in step, e.g. NTP). Service callers
get none: their connections need no grant.

Pure apart from its clocks (injected): reads the master's object table (``table.py``), owns no
sockets or threads; a service of the table, it must not import the state, an RPC module or the
server.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvplane.store.master.table import ObjectTable
from kvplane.store.types import Grant
from kvplane.transfer import grants as g

RETIRE_TTL = 30.0  # seconds a RETIRE grant lasts (the caller retires at once)


class MasterGrants:
    """Makes the grants of tenants' answers.

    Args:
        secret: the master's tag key (segments learn it at mount and derive the same keys).
        tenants: tenant name -> token.
        clock: the master's monotonic clock (leases and windows are on it).
        wall: wall clock, seconds since the epoch.
    """

    def __init__(self, secret: bytes, tenants: dict[str, str], clock: Callable[[], float],
                 wall: Callable[[], float] = time.time) -> None:
        self._secret = secret
        self._ids = {name: g.tenant_id(tok) for name, tok in tenants.items()}
        self._keys: dict[str, bytes] = {}
        self._clock, self._wall = clock, wall

    def tenant_ids(self) -> list[bytes]:
        """The identities of every tenant (told to segments at mount)."""
        return list(self._ids.values())

    def _key(self, segment: str) -> bytes:
        key = self._keys.get(segment)
        if key is None:
            key = self._keys[segment] = g.segment_key(self._secret, segment)
        return key

    def attach(self, method: str, state: ObjectTable, req: Any, out: Any, tenant: str) -> None:
        """Add ``tenant``'s grants to ``out``, the answer of ``method`` to ``req`` (keys
        already scoped)."""
        tid = self._ids.get(tenant)
        if tid is None:
            return
        now, wall_ms = self._clock(), self._wall() * 1000
        found: list[Grant] = []
        if method == "get_replicas":
            for k in req.keys:
                obj = state.objects.get(k)
                if obj is not None and obj.complete:
                    until = int(wall_ms + (obj.lease_until - now) * 1000)
                    found += self._replicas(state, tid, obj, obj.hdr, obj.size, until, g.READ)
        elif method == "put_start":
            for k, r in zip(req.keys, out.results):
                obj = state.objects.get(k) if r.code == 0 else None
                if obj is not None:
                    until = int(wall_ms + (obj.window_until - now) * 1000)
                    found += self._replicas(state, tid, obj, 0, obj.hdr + obj.size, until,
                                            g.READ | g.WRITE)  # (its writer may read back)
        for _, seg, gen in out.retire or ():
            if seg in state.segments:
                base = state.segments[seg].info.base
                found.append((seg, g.make(self._key(seg), tid, gen, base, 0,
                                          int(wall_ms + RETIRE_TTL * 1000), g.RETIRE)))
        if found:
            out.grants = found

    def attach_work(self, work: Any, tenant: str, ttl: float) -> None:
        """Add ``tenant``'s grants to a copy task's ``work`` (a ``TaskWork``): READ on each
        source's value, WRITE on each target's header and value, for ``ttl`` seconds (the
        task's processing timeout)."""
        tid = self._ids.get(tenant)
        if tid is None or work.code:
            return
        until = int((self._wall() + ttl) * 1000)
        found = [(r.segment, g.make(self._key(r.segment), tid, r.gen, r.addr, r.size, until,
                                    g.READ)) for r in work.sources]
        for r, head in zip(work.targets, work.headers or [b""] * len(work.targets)):
            n = len(head)
            found.append((r.segment, g.make(self._key(r.segment), tid, r.gen, r.addr - n,
                                            r.size + n, until, g.WRITE)))
        work.grants = found or None

    def _replicas(self, state: ObjectTable, tid: bytes, obj: Any, skip: int, span: int,
                  until: int, mode: int) -> list[Grant]:
        """Grants on ``[skip, skip+span)`` of each memory replica's allocation."""
        out = []
        for seg, off, gen in obj.replicas:
            s = state.segments.get(seg)
            if s is not None:
                out.append((seg, g.make(self._key(seg), tid, gen, s.info.base + off + skip,
                                        span, until, mode)))
        return out
