"""Grants: what a tenant's data connection may touch in this engine's memory.

A store master with tenants hands each tenant client, with every place it may read (a lookup's
replicas), write (a PutStart's allocations) or retire (a generation it replaced), a *grant*: a
56-byte record naming the allocation's generation, an address range, what it may do there
(``READ``, ``WRITE``, ``RETIRE``), until when (wall-clock milliseconds: the read lease, the
write window), and a 16-byte MAC over those fields and the tenant's identity (``tenant_id``:
a digest of its token), keyed per segment (``segment_key``: derived from the master's secret and
the segment's name, so a grant is good at one segment only). The client installs grants at the
segment's listener (``OP_GRANT``) before its data frames; the listener checks every READ,
WRITE, READV/WRITEV entry and RETIRE generation of a tenant's connection against the grants
installed by that tenant (:class:`GrantTable`): the frame's generation must have a grant of that
mode, unexpired, whose range holds the frame's whole range. Anything else is refused before a
byte moves. Connections that authenticated with the service token (the pool's own segments and
service clients) need no grant.

Pure bookkeeping under one lock (``time.time`` aside); imports nothing from the store.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

READ, WRITE, RETIRE = 1, 2, 4
HEAD = struct.Struct("<QQQQB7x")  # gen, base, span, until (ms since the epoch), mode
GRANT_SIZE = HEAD.size + 16  # the head and its MAC
MAX_GRANTS = 4096  # grants per OP_GRANT frame
KEEP = 1 << 16  # generations remembered per tenant (oldest forgotten first)
PER_GEN = 4  # grants kept per generation (a re-lookup replaces the oldest)
OK, BAD_MAC, EXPIRED, NO_SEGMENT = 0, 1, 2, 3  # install outcome per grant


def tenant_id(token: str) -> bytes:
    """The identity a grant binds: a digest of the tenant's token (16 bytes)."""
    return hashlib.blake2b(token.encode(), digest_size=16, person=b"kvplane-tenant").digest()


def segment_key(secret: bytes, segment: str) -> bytes:
    """The MAC key of the grants for ``segment`` (``secret``: the master's tag key)."""
    return hmac.digest(secret, b"kvplane-grant\0" + segment.encode(), "sha256")


def make(key: bytes, tenant: bytes, gen: int, base: int, span: int, until_ms: int,
         mode: int) -> bytes:
    """One grant: ``tenant`` may do ``mode`` on ``[base, base+span)`` of allocation ``gen`` of
    the segment ``key`` was derived for, until ``until_ms``."""
    head = HEAD.pack(gen, base, span, until_ms, mode)
    return head + hmac.digest(key, tenant + head, "sha256")[:16]


@dataclass(frozen=True, slots=True)
class _Segment:
    base: int
    end: int
    key: bytes


class MountedSegment(NamedTuple):
    """A store segment a listener checks grants for (``GrantTable.mounted``)."""

    name: str
    base: int
    size: int


class Held(NamedTuple):
    """One installed grant: ``mode`` on ``[lo, hi)`` until ``until`` (ms since the epoch)."""

    lo: int
    hi: int
    mode: int
    until: float


class GrantTable:
    """The grants one data listener holds, per tenant. Thread-safe.

    Before :meth:`mounted` every tenant connection is refused (no key to check grants with, no
    list of which peer tokens are tenants). After it, a connection whose token is not one of
    the master's tenants (a service or admin token given as an extra token) needs no grant.

    Args:
        keep: generations remembered per tenant.
        clock: wall clock in seconds (tests may inject one).
    """

    def __init__(self, keep: int = KEEP, clock: Callable[[], float] = time.time) -> None:
        self._lock = threading.Lock()
        self._keep = keep
        self._clock = clock
        self._segments: tuple[_Segment, ...] = ()
        self._tenants: frozenset[bytes] | None = None  # None: not mounted yet
        self._by_tenant: dict[bytes, OrderedDict[int, list[Held]]] = {}
        self.refused = 0  # frames refused for want of a grant
        self.bad = 0  # grants that failed to install

    def mounted(self, secret: bytes, segments: list[MountedSegment] | list[tuple[str, int, int]],
                tenants: list[bytes]) -> None:
        """Check grants for ``segments`` (name, base, size) with the master's ``secret``;
        ``tenants``: the identities of the master's tenants."""
        segs = tuple(_Segment(b, b + n, segment_key(secret, name)) for name, b, n in segments)
        with self._lock:
            self._segments, self._tenants = segs, frozenset(tenants)

    def exempt(self, tenant: bytes) -> bool:
        """True when ``tenant``'s connections need no grant (not one of the master's tenants)."""
        known = self._tenants
        return known is not None and tenant not in known

    def install(self, tenant: bytes, blob: bytes | bytearray) -> list[int]:
        """Verify and keep the grants packed in ``blob`` for ``tenant``; per grant ``OK`` or why
        it was not kept."""
        now = self._clock() * 1000
        out = []
        for k in range(0, len(blob) - GRANT_SIZE + 1, GRANT_SIZE):
            out.append(self._install_one(tenant, bytes(blob[k:k + GRANT_SIZE]), now))
        self.bad += len(out) - out.count(OK)
        return out

    def _install_one(self, tenant: bytes, grant: bytes, now: float) -> int:
        gen, base, span, until, mode = HEAD.unpack_from(grant)
        seg = next((s for s in self._segments if s.base <= base and base + span <= s.end), None)
        if seg is None:
            return NO_SEGMENT
        mac = hmac.digest(seg.key, tenant + grant[:HEAD.size], "sha256")[:16]
        if not hmac.compare_digest(mac, grant[HEAD.size:]):
            return BAD_MAC
        if until < now:
            return EXPIRED
        with self._lock:
            table = self._by_tenant.setdefault(tenant, OrderedDict())
            entries = [e for e in table.pop(gen, []) if e.until >= now][-(PER_GEN - 1):]
            table[gen] = entries + [Held(base, base + span, mode, until)]
            while len(table) > self._keep:
                table.popitem(last=False)
        return OK

    def admits(self, tenant: bytes, gen: int, addr: int, length: int, mode: int) -> bool:
        """True when ``tenant`` may do ``mode`` on ``[addr, addr+length)`` of generation
        ``gen`` now (always, for an exempt identity)."""
        if self.exempt(tenant):
            return True
        table = self._by_tenant.get(tenant)
        entries = table.get(gen) if table is not None and gen else None
        if entries:
            now = self._clock() * 1000
            end = addr + length
            for lo, hi, m, until in entries:
                if m & mode and lo <= addr and end <= hi and now <= until:
                    return True
        self.refused += 1
        return False

    def may_retire(self, tenant: bytes, gens: list[int]) -> bool:
        """True when ``tenant`` holds an unexpired RETIRE grant for every generation in
        ``gens`` (always, for an exempt identity)."""
        if self.exempt(tenant):
            return True
        table: dict[int, list[Held]] = self._by_tenant.get(tenant) or {}
        now = self._clock() * 1000
        for g in gens:
            if not any(m & RETIRE and now <= until for _, _, m, until in table.get(g, ())):
                self.refused += 1
                return False
        return True
