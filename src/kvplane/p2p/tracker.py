"""TrackerState: who holds which chunk of which version, who is fetching, and what to collect.

The pure core of the P2P tracker (served over HTTP by ``p2p.tracker_api``). It keeps, per
object name, its versions; per version the manifest, the holders of every chunk (holder =
transfer-engine segment name, with the chunk's address there), the readers' leases and their
fetches in flight; per holder its load and liveness. Receivers ask it for their next fetches
(``claim``) and report what they got; each reported chunk makes its receiver a holder at once.

Versions: publishing N+1 retires N. A retired version stays while a reader holds a lease on
it and is then collected; holders learn it from their next heartbeat and free the memory.

Pure: no sockets, threads or clocks; every call that needs the time takes ``now`` (seconds,
monotonic). Imports ``kvplane.common`` and ``kvplane.p2p`` pure modules only.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvplane.common.errors import Conflict, InvalidArgument, NoSpace, NotFound
from kvplane.p2p import planner
from kvplane.p2p.manifest import Manifest, check_name, validate

FAIL_REASONS = ("corrupt", "unreachable", "timeout")
MAX_VERSIONS = 10_000  # (name, version) pairs kept at once, retired ones included


@dataclass
class Reader:
    """One receiver fetching one version."""

    expires: float
    addrs: list[int] = field(default_factory=list)
    inflight: dict[int, str] = field(default_factory=dict)  # chunk -> holder
    got: set[int] = field(default_factory=set)
    banned: set[tuple[int, str]] = field(default_factory=set)


@dataclass
class Version:
    """One published version and its swarm."""

    manifest: Manifest
    gold: str
    holders: list[dict[str, int]]
    retired: bool = False
    readers: dict[str, Reader] = field(default_factory=dict)
    served: dict[str, int] = field(default_factory=dict)  # holder -> chunks served
    first_served: dict[str, float] = field(default_factory=dict)  # holder -> first time
    completed: dict[str, float] = field(default_factory=dict)  # reader -> time it had all
    failures: dict[str, int] = field(default_factory=dict)  # reason -> count


@dataclass
class Holder:
    """A node that serves chunks: liveness and load."""

    seen: float
    load: int = 0
    suspect_since: float | None = None


@dataclass(frozen=True)
class Claim:
    """The answer to a claim: fetches to start, and chunks no live holder has."""

    assign: list[planner.Assignment]
    left: int
    unavailable: list[int]


class TrackerState:
    """The tracker's state machine (not thread-safe: one caller at a time).

    Args:
        holder_ttl: seconds without a heartbeat after which a holder is dropped.
        lease_ttl: seconds a reader's lease lasts without a claim.
        max_uploads: most fetches one holder serves at once.
        seed: seeds the planner's tie-breaking.
    """

    def __init__(self, holder_ttl: float = 5.0, lease_ttl: float = 15.0, max_uploads: int = 4,
                 seed: int = 0) -> None:
        if holder_ttl <= 0 or lease_ttl <= 0 or max_uploads < 1:
            raise InvalidArgument("ttls must be > 0 and max_uploads >= 1")
        self.holder_ttl, self.lease_ttl, self.max_uploads = holder_ttl, lease_ttl, max_uploads
        self.objects: dict[str, dict[int, Version]] = {}
        self.latest: dict[str, int] = {}
        self.holders: dict[str, Holder] = {}
        self._rng = random.Random(seed)

    # -- publish / withdraw (Mooncake Register / Unregister / DeleteReplica) ----------------
    def publish(self, manifest: Manifest, holder: str, addrs: list[int], now: float) -> int:
        """Register ``holder`` as the publisher of a new version; returns its number.

        ``manifest.version`` 0 means "the next one". Older versions are retired.

        Raises:
            Conflict: the version is not newer than the latest. InvalidArgument: bad input.
        """
        validate(manifest)
        name = manifest.name
        if len(addrs) != len(manifest.chunks):
            raise InvalidArgument(f"{len(addrs)} addresses for {len(manifest.chunks)} chunks")
        versions = self.objects.get(name, {})
        latest = max(self.latest.get(name, 0), max(versions, default=0))  # removed ones count
        version = manifest.version or latest + 1
        if version <= latest:
            raise Conflict(f"{name} version {version} is not newer than {latest}")
        if sum(len(vs) for vs in self.objects.values()) >= MAX_VERSIONS:
            raise NoSpace(f"the tracker keeps {MAX_VERSIONS} versions at most")
        versions = self.objects.setdefault(name, {})
        for v in versions.values():
            v.retired = True
        versions[version] = Version(manifest.with_version(version), holder,
                                    [{holder: a} for a in addrs])
        self.latest[name] = version
        self._touch(holder, now)
        return version

    def withdraw(self, name: str, version: int, holder: str) -> int:
        """Stop using ``holder`` for ``name`` (one version, or all with 0); returns how many."""
        n = 0
        for v in self._versions(name, version):
            for hs in v.holders:
                n += hs.pop(holder, None) is not None
        return n

    def remove(self, name: str) -> None:
        """Retire every version of ``name`` (rm); each is collected once no reader holds it.

        Raises:
            NotFound: unknown name.
        """
        for v in self._versions(name, 0):
            v.retired = True
        self.latest.pop(name, None)

    # -- readers (Mooncake GetReplica) -------------------------------------------------------
    def open(self, name: str, version: int, reader: str, now: float) -> Manifest:
        """Start a fetch: a lease on ``version`` (0: the latest) for ``reader``; the manifest.

        Raises:
            NotFound: no such name or version (or it was removed).
        """
        check_name(name)
        if version == 0:
            version = self.latest.get(name, 0)
        v = self.objects.get(name, {}).get(version)
        if v is None or (version == 0):
            raise NotFound(f"no object {name!r} version {version or 'latest'}")
        v.readers[reader] = Reader(now + self.lease_ttl)
        self._touch(reader, now)
        return v.manifest

    def claim(self, name: str, version: int, reader: str, *, now: float,
              addrs: list[int] | None = None, done: Sequence[tuple[int, str]] = (),
              failed: Sequence[tuple[int, str, str]] = (), want: int = 0,
              strategy: str = "rarest") -> Claim:
        """Record ``done``/``failed`` fetches, then pick up to ``want`` new ones.

        A chunk in ``done`` makes ``reader`` a holder of it at once (at ``addrs[chunk]``).

        Raises:
            NotFound: no lease (never opened, expired or collected).
            InvalidArgument: bad addresses, chunk numbers or reasons.
        """
        v, r = self._reader(name, version, reader)
        n = len(v.manifest.chunks)
        if addrs is not None:
            if len(addrs) != n:
                raise InvalidArgument(f"{len(addrs)} addresses for {n} chunks")
            r.addrs = list(addrs)
        r.expires = now + self.lease_ttl
        self._touch(reader, now, clear=False)
        for c, src in done:
            self._done(v, r, reader, self._chunk(c, n), src, now)
        for c, src, why in failed:
            self._failed(v, r, self._chunk(c, n), src, why, now)
        missing = [c for c in range(n) if c not in r.got and c not in r.inflight]
        assign: list[planner.Assignment] = []
        if want > 0 and missing:
            load = {h: s.load for h, s in self.holders.items()}
            usable = {h for h, s in self.holders.items() if s.suspect_since is None and h != reader}
            pending: dict[int, int] = {}
            for other in v.readers.values():
                for c in other.inflight:
                    pending[c] = pending.get(c, 0) + 1
            assign = planner.choose(missing, v.holders, load, want, strategy=strategy,
                                    gold=(v.gold,), usable=usable, banned=r.banned,
                                    max_uploads=self.max_uploads, pending=pending, rng=self._rng)
            for c, h, _ in assign:
                r.inflight[c] = h
                self.holders[h].load += 1
        lost = planner.unavailable(missing, v.holders, set(self.holders) - {reader})
        return Claim(assign, n - len(r.got), lost)

    def close(self, name: str, version: int, reader: str) -> None:
        """End ``reader``'s lease (it stays a holder of what it got)."""
        v = self.objects.get(name, {}).get(version)
        if v is not None and reader in v.readers:
            self._release(v, v.readers.pop(reader))

    # -- holders -----------------------------------------------------------------------------
    def heartbeat(self, holder: str, holdings: Sequence[tuple[str, int]], now: float,
                  reading: Sequence[tuple[str, int]] = ()) -> list[tuple[str, int]]:
        """A node is alive: renew its leases on ``reading``; returns the holdings to drop."""
        self._touch(holder, now)
        for name, ver in reading:  # a fetch whose chunks are slow keeps its lease
            r = self.objects.get(name, {}).get(ver)
            if r is not None and holder in r.readers:
                r.readers[holder].expires = now + self.lease_ttl
        return [(n, ver) for n, ver in holdings if ver not in self.objects.get(n, {})]

    def expire(self, now: float) -> list[tuple[str, int]]:
        """Drop silent holders, expired leases and unheld retired versions; returns collected."""
        for h in [h for h, s in self.holders.items() if now - s.seen > self.holder_ttl]:
            del self.holders[h]
            for versions in self.objects.values():
                for v in versions.values():
                    for hs in v.holders:
                        hs.pop(h, None)
        gone: list[tuple[str, int]] = []
        for name, versions in list(self.objects.items()):
            for num, v in list(versions.items()):
                for rd in [k for k, r in v.readers.items() if r.expires < now]:
                    self._release(v, v.readers.pop(rd))
                if v.retired and not v.readers:
                    del versions[num]
                    gone.append((name, num))
            if not versions:
                del self.objects[name]
        return gone

    # -- views -------------------------------------------------------------------------------
    def ls(self, prefix: str = "") -> list[dict[str, object]]:
        """One summary per name starting with ``prefix``."""
        out = []
        for name in sorted(n for n in self.objects if n.startswith(prefix)):
            vs = self.objects[name]
            out.append({"name": name, "latest": self.latest.get(name, 0), "versions": [
                {"version": k, "size": v.manifest.total_size, "chunks": len(v.holders),
                 "holders": len({h for hs in v.holders for h in hs}), "readers": len(v.readers),
                 "retired": v.retired} for k, v in sorted(vs.items())]})
        return out

    def status(self, name: str, version: int) -> dict[str, object]:
        """The swarm of one version (tests and operators)."""
        v = self._versions(name, version or self.latest.get(name, 0))[0]
        return {"version": v.manifest.version, "gold": v.gold,
                "holders_per_chunk": [len(hs) for hs in v.holders],
                "holders": sorted({h for hs in v.holders for h in hs}),
                "load": {h: s.load for h, s in self.holders.items() if s.load},
                "inflight": {rd: dict(r.inflight) for rd, r in v.readers.items() if r.inflight},
                "served": dict(v.served), "first_served": dict(v.first_served),
                "completed": dict(v.completed), "failures": dict(v.failures),
                "suspects": sorted(h for h, s in self.holders.items() if s.suspect_since is not None),
                "retired": v.retired, "readers": sorted(v.readers)}

    # -- internals ---------------------------------------------------------------------------
    def _versions(self, name: str, version: int) -> list[Version]:
        vs = self.objects.get(name)
        if not vs or (version and version not in vs):
            raise NotFound(f"no object {name!r}" + (f" version {version}" if version else ""))
        return [vs[version]] if version else list(vs.values())

    def _reader(self, name: str, version: int, reader: str) -> tuple[Version, Reader]:
        v = self.objects.get(name, {}).get(version)
        r = v.readers.get(reader) if v else None
        if v is None or r is None:
            raise NotFound(f"{reader} holds no lease on {name!r} version {version}")
        return v, r

    @staticmethod
    def _chunk(c: int, n: int) -> int:
        if not 0 <= c < n:
            raise InvalidArgument(f"chunk {c} out of range")
        return c

    def _touch(self, holder: str, now: float, clear: bool = True) -> None:
        h = self.holders.get(holder)
        if h is None:
            self.holders[holder] = Holder(now)
            return
        h.seen = now
        if clear and h.suspect_since is not None and now > h.suspect_since:
            h.suspect_since = None

    def _unload(self, r: Reader, c: int) -> None:
        src = r.inflight.pop(c, None)
        if src is not None and src in self.holders:
            self.holders[src].load = max(0, self.holders[src].load - 1)

    def _done(self, v: Version, r: Reader, reader: str, c: int, src: str, now: float) -> None:
        self._unload(r, c)
        if c in r.got:
            return
        if not r.addrs:
            raise InvalidArgument("report chunk addresses (addrs) before chunks")
        r.got.add(c)
        v.holders[c][reader] = r.addrs[c]
        v.served[src] = v.served.get(src, 0) + 1
        v.first_served.setdefault(src, now)
        if len(r.got) == len(v.holders):
            v.completed[reader] = now

    def _failed(self, v: Version, r: Reader, c: int, src: str, why: str, now: float) -> None:
        if why not in FAIL_REASONS:
            raise InvalidArgument(f"failure reason {why!r}: one of {FAIL_REASONS}")
        self._unload(r, c)
        v.failures[why] = v.failures.get(why, 0) + 1
        if why == "corrupt":  # its bytes for this chunk are wrong: nobody may use them
            r.banned.add((c, src))
            v.holders[c].pop(src, None)
        elif src in self.holders:  # dead or stalled: unused until it heartbeats again
            self.holders[src].suspect_since = now

    def _release(self, v: Version, r: Reader) -> None:
        for c in list(r.inflight):
            self._unload(r, c)
