"""StoreClient: the blocking store client (Mooncake semantics; batch is the primitive).

A put is PutStart (master allocates replicas) -> transfer-engine writes -> PutEnd (or
PutRevoke on failure). A get is GetReplicaList (master grants a read lease) -> a transfer from
the best replica (same host first, through shared memory) -> fail over to the next replica.
Bytes never pass through the master. A client with ``global_segment_size > 0`` contributes a
shared-memory segment to the pool and heartbeats; after a master restart or a leader change it
remounts and re-registers the objects its segment holds (``remount``). The master may be one
``host:port`` or an HA cluster ``etcd://h1:2379;h2:2379`` (``link``: calls follow the leader and
retry within their deadline). Every put writes the object's inventory header (built by the
master) in front of its value in every replica.

Errors: single-key calls raise from the ``kvplane.common.errors`` tree (``ObjectNotFound``,
``TransferFail``, ``NoAvailableHandle``, ``Timeout``...; see docs/errors.md). Batch calls return
one entry per key, where a failed key holds its exception instance instead of a value (as
``asyncio.gather(return_exceptions=True)`` does); a failure of the whole call (master
unreachable, bad arguments) raises. Mooncake's integer codes exist only in ``kvplane.compat``.

Integrity (docs/store.md, "Guarantees"): one deadline per call (``moves``), puts committed only
when the master's PutEnd says so, reads inside the master's lease and checked against the
object's checksum, failed segments reported to the master; a client with a segment also fences
generations and runs re-replication tasks for the master (``duty``).

Why blocking and not asyncio at the core: a store op is two round trips of ~30 us each here, and
an event-loop hop per call costs as much again. The asyncio facade (``aio.AsyncStoreClient``)
runs this core in a thread pool, as Mooncake's async store does.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import numpy as np

from kvplane.common import log as klog
from kvplane.common.deadline import Deadline
from kvplane.common.auth import client_token
from kvplane.common.errors import KVPlaneError, Timeout, Unauthorized, Unavailable
from kvplane.store.checksum import digest
from kvplane.store.config import StoreConfig
from kvplane.store.disk.node import DiskDuty
from kvplane.store.client import moves
from kvplane.store.client.duty import SegmentDuty
from kvplane.store.client.link import MasterLink
from kvplane.store.client import grants, locations, spares, tiering
from kvplane.store.client.locations import Locations
from kvplane.store.client.remount import Holdings
from kvplane.store.client.staging import Staging
from kvplane.store.errors import (
    InvalidParams, ObjectExists, TransferFail, ValueTooLarge, key_error,
)
from kvplane.store.types import (
    CodesRep, KeyResult, KeysReq, ListKeysRep, ListKeysReq, Location, MountRep, MountReq, PingRep,
    PingReq, PutEndReq, RegexReq, RemoveReq, ReplicateConfig, ResultsRep, SegmentInfo,
    column_results,
)
from kvplane.transfer import EngineConfig, TransferEngine

log = logging.getLogger(__name__)
WRITE_RESERVE = 0.2  # share of a put's time (at most 1 s) kept for PutEnd / PutRevoke
FENCE_WORD = 64  # bytes at the start of a contributed segment: its fence word, never allocated


class StoreClient:
    """A store client. Thread-safe; every call is bounded by ``config.timeout``.

    Args:
        config: a StoreConfig; keyword ``overrides`` replace its fields.
    """

    def __init__(self, config: StoreConfig | None = None, **overrides: Any) -> None:
        cfg = config or StoreConfig.from_env()
        if overrides:
            cfg = StoreConfig(**{**cfg.__dict__, **overrides})
        try:
            self._start(cfg)
        except Unauthorized:
            # No token yet, and the server wants one: a client started with ``kvplane serve``
            # may have looked for the token file before serve wrote it. Read it again, once.
            token = "" if cfg.token else client_token()
            if not token:
                raise
            self._start(StoreConfig(**{**cfg.__dict__, "token": token}))

    def _start(self, cfg: StoreConfig) -> None:
        """Open the engine, the master link and the segments, and mount (all or nothing)."""
        self.config = cfg
        self.engine = TransferEngine(EngineConfig.from_env(
            host=cfg.local_hostname, port=cfg.port, metadata=cfg.metadata,
            protocol=cfg.protocol, token=cfg.token, timeout=cfg.timeout,
            extra_tokens=cfg.peer_tokens or None,
            grants=bool(cfg.global_segment_size > 0 and cfg.peer_tokens)))
        self._handles: dict[str, int] = {}
        self._segments: list[SegmentInfo] = []
        self._closed = threading.Event()
        self.remounts = 0
        self._largest_segment = 0  # the master's last ValueTooLarge answer named it
        self.suspects = moves.Suspects()
        self.retired = moves.Retired()
        self.duty = SegmentDuty(self)
        self.holdings = Holdings(self)
        self.corrupt_reads = 0  # replica reads whose bytes failed the checksum
        self.locations = Locations(cfg.location_cache)  # where recent keys are (speculative gets)
        self.spares = spares.Spares(cfg.spares)  # space placed one put ahead (two-hop puts)
        self.lease_ttl = cfg.lease_ttl  # the master's read lease, as its last lookup said
        self._listened: dict[int, bool] = {}  # segment handle -> reads go through its listener
        self.disk_links = tiering.DiskLinks(cfg.token)
        self.disk: DiskDuty | None = None
        try:
            self.rpc = MasterLink(cfg.master, cfg.token, cfg.timeout)
            self.staging = Staging(self.engine, cfg.local_buffer_size)
            if cfg.global_segment_size > 0:
                if cfg.global_segment_size <= 2 * FENCE_WORD:
                    raise InvalidParams("global_segment_size is too small")
                buf = self.engine.allocate_managed_buffer(cfg.global_segment_size,
                                                         populate=cfg.populate, fenced=True)
                self._segments = [SegmentInfo(self.engine.name, buf.addr + FENCE_WORD,
                                              cfg.global_segment_size - FENCE_WORD,
                                              cfg.client_id, self.engine.name,
                                              self.engine.host_id)]
                if cfg.disk_dir:
                    self.disk = DiskDuty(self)
                    self.disk.describe(self._segments[0])
            self.mount()
        except BaseException:  # a failed start leaves no listener, thread or shared memory
            self._closed.set()
            if self.disk is not None:
                self.disk.close()
            if hasattr(self, "rpc"):
                self.rpc.close()
            self.engine.close()
            raise
        self._hb = threading.Thread(target=self._heartbeat, daemon=True,
                                    name=f"store-heartbeat-{cfg.client_id[:8]}")
        self._hb.start()

    # -- liveness ------------------------------------------------------------------------------
    def mount(self) -> None:
        """(Re)register this client and its segments with the master: the master's epoch (and
        floor) become what this segment's listener admits, and the objects the segment already
        holds are re-registered (``remount``)."""
        history = self.holdings.history
        rep = self.rpc.call("mount", MountReq(self.config.client_id, self._segments, history,
                                              adopt=bool(self._segments and history)), MountRep)
        if self.disk is not None and rep.epoch > 0:  # before the memory records: their last
            self.disk.mounted(rep.epoch, rep.secret)  # batch ends a recovering master's wait
        if self._segments and rep.epoch > 0:
            self.engine.grants.mounted(rep.secret, [(s.name, s.base, s.size)
                                                    for s in self._segments], rep.tenants)
            self.holdings.mounted(rep)
        if rep.tenant:  # a tenant: never shared memory or same-host paths, only listeners
            grants.tenant_transfers(self.engine)

    def _heartbeat(self) -> None:
        failures, acks = 0, ([], [])
        while any(acks) or not self._closed.wait(self.config.heartbeat_interval):
            try:
                acks = self._ping(*acks)
                failures = 0
            except KVPlaneError as exc:
                acks = ([], [])  # the master sends fences and forgets again until acknowledged
                failures += 1
                if failures in (1, 3) or failures % 30 == 0:
                    log.warning("heartbeat to master %s failed (%d): %s",
                                self.config.master, failures, exc)

    def _ping(self, acks: list[int], forgot: list[int]) -> tuple[list[int], list[int]]:
        """One heartbeat; returns fence and forget acknowledgements to send at once."""
        rep = self.rpc.call("ping", PingReq(self.config.client_id, acks, self.suspects.take(),
                                            forgot, self.retired.take()), PingRep,
                            timeout=min(self.config.timeout, 5.0))
        if rep.status == "need_remount":
            self.locations.drop_holds()  # a master that lost its leases: hold nothing of old
            self.spares.close()  # nor its spares
            self.mount()
            self.engine.publish()
            self.remounts += 1
            klog.event("store_remounted", client_id=self.config.client_id)
        if rep.repairs:
            self.duty.submit(rep.repairs)
        self.engine.prune()  # unmap the shared memory of segments whose process is gone
        return self.duty.fence(rep.fences), self.holdings.forget(rep.forgets)

    def health_check(self, timeout: float = 2.0) -> None:
        """Ping the master.

        Raises:
            Unavailable: the client is closed or the master cannot be reached.
            Timeout: the master did not answer within ``timeout`` seconds.
        """
        if self._closed.is_set():
            raise Unavailable("the store client is closed")
        self.rpc.call("ping", PingReq(self.config.client_id), PingRep, timeout=timeout, once=True)

    # -- transfers ----------------------------------------------------------------------------
    def segment_handle(self, segment: str, deadline: Deadline | None = None) -> int:
        """The engine's handle of ``segment``, opened once (bounded by ``deadline``)."""
        h = self._handles.get(segment)
        if h is None:
            left = self.config.timeout if deadline is None else deadline.check("segment lookup")
            h = self.engine.open_segment(segment, timeout=min(left, 5.0))
            self._handles[segment] = h
        return h

    def _call(self, method: str, req: Any, typ: type, deadline: Deadline,
              meanwhile: Callable[[], None] | None = None) -> Any:
        """A master RPC bounded by what is left of the call's deadline (``meanwhile``: see
        ``MasterLink.call``)."""
        rep = self.rpc.call(method, req, typ, meanwhile=meanwhile,
                            timeout=moves.coarse(deadline.check(f"store {method}")))
        if getattr(rep, "grants", None):  # a tenant's: installed before any transfer there
            grants.install(self, rep.grants, deadline)
        return rep

    # -- zero-copy batch primitives ---------------------------------------------------------------
    def batch_put_from(self, keys: list[str], addrs: list[int], sizes: list[int],
                       config: ReplicateConfig | None = None,
                       upsert: bool = False) -> list[KVPlaneError | None]:
        """Store ``sizes[i]`` bytes at registered ``addrs[i]`` under ``keys[i]``.

        Returns:
            Per key None (stored, or already present: a put never overwrites unless
            ``upsert=True``) or the exception that key failed with.

        Raises:
            InvalidParams: the lists differ in length.
            Unavailable, Timeout: the master could not be reached.
        """
        if not len(keys) == len(addrs) == len(sizes):
            raise InvalidParams("keys, buffers and sizes differ in length")
        if not keys:
            return []
        codes = self._put_codes(list(keys), [int(a) for a in addrs], [int(s) for s in sizes],
                                config or ReplicateConfig(), upsert)
        return [None if c in (0, ObjectExists.code) else self._put_error(c, k, n)
                for k, c, n in zip(keys, codes, sizes)]

    def _put_error(self, code: int, key: str, size: int) -> KVPlaneError:
        if code == ValueTooLarge.code:  # the master named its largest segment with the code
            return ValueTooLarge(ValueTooLarge.message(key, size, self._largest_segment))
        return key_error(code, key)

    def _put_codes(self, keys: list[str], addrs: list[int], sizes: list[int],
                   cfg: ReplicateConfig, upsert: bool) -> list[int]:
        deadline = Deadline.after(self.config.timeout)
        # every put is checksummed: the inventory header carries it, and a segment re-registers
        # an object after a failover only if its bytes still match (checking it on gets is
        # what ``config.checksum`` turns on)
        sums = [digest(self.engine.memory.view(a, n)) for a, n in zip(addrs, sizes)]
        reserve = min(WRITE_RESERVE * self.config.timeout, 1.0)
        shape = spares.ask(keys, sizes, cfg, upsert) if self.spares.enabled else None
        if shape is not None:  # write into the spare the last PutEnd placed, then commit
            code = spares.put(self, keys[0], addrs[0], sizes[0], cfg, sums[0], shape, deadline,
                              reserve)
            if code is not None:
                return [code]
        sent = time.monotonic()
        rep = tiering.put_start(self, keys, sizes, cfg, upsert, sums, deadline)
        codes = [r.code for r in rep.results]
        for r in rep.results:
            if r.code == ValueTooLarge.code:
                self._largest_segment = r.size
        unretired = moves.retire(self, rep.retire, deadline) if rep.retire else set()
        ok = [i for i, c in enumerate(codes) if c == 0 and i not in unretired]
        window = sent + rep.ttl if rep.ttl > 0 else deadline.at  # copies must start inside it
        failed = moves.put_write(self, rep.results, ok, addrs, sizes,
                                 Deadline(min(deadline.at - reserve, window)))
        failed |= {i for i in unretired if codes[i] == 0}  # not made safe: not committed
        ends = [(keys[i], rep.results[i].version, sums[i], i) for i in ok if i not in failed]
        revokes = [(keys[i], rep.results[i].version) for i in sorted(failed)]
        if ends:
            sent = time.monotonic()
            end = self._call("put_end", PutEndReq(
                self.config.client_id, [e[0] for e in ends], [e[1] for e in ends],
                [e[2] for e in ends], self.suspects.take(), spare=shape,
                returns=self.spares.returns()), CodesRep, deadline)
            if shape is not None:
                self.spares.offer(end.spare, shape, sent)
            got = end.codes
            for (_, _, _, i), code in zip(ends, got):
                if code:  # not committed (pre-empted, or lost with its segment): not a success
                    codes[i] = TransferFail.code
        if revokes:
            self._call("put_revoke", PutEndReq(self.config.client_id, [k for k, _ in revokes],
                                               [v for _, v in revokes], [], self.suspects.take(),
                                               returns=self.spares.returns()),
                       CodesRep, deadline)
        for i in failed:
            codes[i] = TransferFail.code
        locations.remember(self, keys, rep.results, [i for i in ok if codes[i] == 0], sizes)
        return codes

    def batch_get_into(self, keys: list[str], addrs: list[int],
                       sizes: list[int]) -> list[int | KVPlaneError]:
        """Read objects into registered buffers.

        Returns:
            Per key the bytes read, or the exception that key failed with (``ObjectNotFound``,
            ``InvalidParams`` for a buffer too small, ``TransferFail``, ``LeaseExpired``).
        """
        if not len(keys) == len(addrs) == len(sizes):
            raise InvalidParams("keys, buffers and sizes differ in length")
        if not keys:
            return []
        got = locations.get_into(self, list(keys), list(map(int, addrs)), list(map(int, sizes)),
                                 Deadline.after(self.config.timeout))
        return [n if n >= 0 else key_error(n, k) for k, n in zip(keys, got)]

    def _lookup(self, keys: list[str], deadline: Deadline,
                meanwhile: Callable[[], None] | None = None,
                expect: list[Location | None] | None = None,
                columns: bool = False) -> tuple[ResultsRep, float]:
        """The master's answer to a lookup of ``keys`` and the local time its read lease ends
        (the master's TTL, counted from before the request was sent). ``meanwhile`` runs
        while the master answers; ``expect`` and ``columns``: see ``KeysReq`` (no columns with
        checksums on)."""
        sent = time.monotonic()
        columns = columns and not self.config.checksum  # (the columns carry no checksums)
        rep = self._call("get_replicas", KeysReq(self.config.client_id, list(keys),
                                                 self.suspects.take(), expect, columns),
                         ResultsRep, deadline, meanwhile)
        if rep.ttl > 0:
            self.lease_ttl = rep.ttl
        return rep, sent + self.lease_ttl

    def _results(self, keys: list[str], rep: ResultsRep, deadline: Deadline) -> list[KeyResult]:
        """Per key the result in ``rep`` (None for a key confirmed where it was expected), with
        the objects that are on disk only served first."""
        results = rep.results
        if rep.columns is not None:
            results = column_results(rep.columns)
        elif rep.stale is not None:  # the answer names only the keys that are not where expected
            if len(rep.stale) != len(results):
                raise Unavailable("the master's answer does not match its list of keys")
            full: list[KeyResult | None] = [None] * len(keys)
            for i, r in zip(rep.stale, results):
                full[i] = r
            results = full  # type: ignore[assignment]
        if tiering.cold(results):  # on disk only: the owner reads them into memory first
            results = tiering.read_through(self, list(keys), results, deadline)
        return results

    def _get_replicas(self, keys: list[str], deadline: Deadline,
                      meanwhile: Callable[[], None] | None = None,
                      expect: list[Location | None] | None = None
                      ) -> tuple[list[KeyResult], float]:
        """The replicas and the local time their read lease ends (:meth:`_lookup`); with
        ``expect``, None for the keys the master confirmed."""
        rep, lease_end = self._lookup(keys, deadline, meanwhile, expect)
        return self._results(keys, rep, deadline), lease_end

    # -- the rest of the API --------------------------------------------------------------------------
    def put_from(self, key: str, addr: int, size: int, config: ReplicateConfig | None = None) -> None:
        """Store ``size`` bytes at registered ``addr`` under ``key`` (a no-op if it exists)."""
        _raise(self.batch_put_from([key], [addr], [size], config)[0])

    def get_into(self, key: str, addr: int, size: int) -> int:
        """Read ``key`` into a registered buffer; returns the bytes read."""
        addr, size = int(addr), int(size)
        deadline = Deadline.after(self.config.timeout)
        if self.locations.capacity:
            n = locations.held_one(self, key, addr, size, deadline)
            if n is not None:
                return n
        n = locations.get_into(self, [key], [addr], [size], deadline)[0]
        return n if n >= 0 else _value(key_error(n, key))

    def put_batch(self, keys: list[str], values: list[bytes], config: ReplicateConfig | None = None,
                  upsert: bool = False) -> list[KVPlaneError | None]:
        """Copying form: values are staged in registered memory, then written."""
        with ExitStack() as stack:
            addrs = []
            for v in values:
                addr, view = stack.enter_context(self.staging.block(len(v)))
                view[:] = np.frombuffer(v, np.uint8)
                addrs.append(addr)
            return self.batch_put_from(keys, addrs, [len(v) for v in values], config, upsert)

    def put(self, key: str, value: bytes, config: ReplicateConfig | None = None) -> None:
        """Store ``value`` under ``key`` (a no-op if the key exists: puts never overwrite)."""
        _raise(self.put_batch([key], [value], config)[0])

    def upsert(self, key: str, value: bytes, config: ReplicateConfig | None = None) -> None:
        """Store ``value`` under ``key``, replacing any object already there."""
        _raise(self.put_batch([key], [value], config, upsert=True)[0])

    def upsert_from(self, key: str, addr: int, size: int, config: ReplicateConfig | None = None) -> None:
        """Zero-copy form of :meth:`upsert`."""
        _raise(self.batch_put_from([key], [addr], [size], config, upsert=True)[0])

    def get_batch(self, keys: list[str]) -> list[bytes | KVPlaneError]:
        """Copying form: per key the bytes, or the exception that key failed with. Keys this
        client knows the place of are read while the master looks them up, as in
        :meth:`batch_get_into` (``locations``)."""
        keys = list(keys)
        deadline = Deadline.after(self.config.timeout)
        out: list[bytes | KVPlaneError | None] = [None] * len(keys)
        sizes = locations.sizes(self, keys)
        if sizes is not None:
            got = self._staged(sizes, lambda addrs: locations.get_into(self, keys, addrs, sizes,
                                                                       deadline))
            for i, v in enumerate(got):  # type: ignore[arg-type]
                if isinstance(v, bytes):
                    out[i] = v
                elif v != InvalidParams.code:  # (that one grew: read below at its new size)
                    out[i] = key_error(v, keys[i])
        rest = [i for i, o in enumerate(out) if o is None]
        if rest:
            for i, o in zip(rest, self._get_copies([keys[i] for i in rest], deadline)):
                out[i] = o
        return out  # type: ignore[return-value]

    def _get_copies(self, keys: list[str], deadline: Deadline) -> list[bytes | KVPlaneError]:
        """:meth:`get_batch` by the master's answer: staging sized by it, then the reads."""
        rep, lease_end = self._lookup(keys, deadline, columns=True)
        cols = rep.columns
        if cols is not None:
            got = self._staged(cols.size, lambda addrs: locations.read_columns(
                self, keys, cols, addrs, cols.size, deadline, lease_end))
            if got is not None:
                return [v if isinstance(v, bytes) else key_error(v, k) for k, v in zip(keys, got)]
        results = self._results(keys, rep, deadline)
        hits = [i for i, r in enumerate(results) if r.code == 0]
        out: list[bytes | KVPlaneError] = [key_error(r.code, k) if r.code else b""
                                           for k, r in zip(keys, results)]
        got = self._staged([results[i].size for i in hits], lambda addrs: tiering.read(
            self, [results[i] for i in hits], addrs, [results[i].size for i in hits], deadline,
            lease_end))
        for i, v in zip(hits, got):  # type: ignore[arg-type]
            out[i] = v if isinstance(v, bytes) else key_error(v, keys[i])
        locations.remember(self, keys, results, [i for i, v in zip(hits, got)  # type: ignore[arg-type]
                                                 if isinstance(v, bytes)], until=lease_end)
        return out

    def _staged(self, sizes: list[int], read: Callable[[list[int]], list[int] | None]
                ) -> list[bytes | int] | None:
        """``read`` into staging blocks of ``sizes``: per key its bytes, or the error code
        ``read`` gave it; None if ``read`` did."""
        with ExitStack() as stack:
            blocks = [stack.enter_context(self.staging.block(n)) for n in sizes]
            got = read([a for a, _ in blocks])
            if got is None:
                return None
            return [view[:n].tobytes() if n >= 0 else n for n, (_, view) in zip(got, blocks)]

    def get(self, key: str) -> bytes:
        """The bytes stored under ``key``.

        Raises:
            ObjectNotFound: no complete object under ``key``.
            TransferFail: every replica failed to transfer.
        """
        return _value(self.get_batch([key])[0])

    def batch_exists(self, keys: list[str]) -> list[bool]:
        """Per key, whether a complete object exists (each hit takes a read lease, as in Mooncake)."""
        codes = self.rpc.call("exist", KeysReq(self.config.client_id, list(keys),
                                               self.suspects.take()), CodesRep).codes
        return [c == 1 for c in codes]

    def exists(self, key: str) -> bool:
        return self.batch_exists([key])[0]

    def get_size(self, key: str) -> int:
        """Size in bytes of the object under ``key`` (raises ObjectNotFound)."""
        size = self.rpc.call("get_size", KeysReq(self.config.client_id, [key]), CodesRep).codes[0]
        if size < 0:
            raise key_error(size, key)
        return size

    def batch_remove(self, keys: list[str], force: bool = False) -> list[KVPlaneError | None]:
        """Remove objects; per key None or the exception (ObjectNotFound, ObjectHasLease...)."""
        self.locations.forget(keys)
        deadline = Deadline.after(self.config.timeout)
        rep = self._call("remove", RemoveReq(self.config.client_id, list(keys), force), CodesRep,
                         deadline)
        if rep.retire:  # forced while leased: readers holding the lease must stop now
            moves.retire(self, rep.retire, deadline)  # (what fails goes by heartbeat)
        return [key_error(c, k) if c else None for k, c in zip(keys, rep.codes)]

    def remove(self, key: str, force: bool = False) -> None:
        """Remove ``key``; ``force`` ignores read leases."""
        _raise(self.batch_remove([key], force)[0])

    def remove_by_regex(self, pattern: str, force: bool = False) -> int:
        """Remove every key matching ``pattern``; returns how many went."""
        re.compile(pattern)
        self.locations.clear()
        return self.rpc.call("remove_regex", RegexReq(self.config.client_id, pattern, force), int)

    def remove_all(self, force: bool = False) -> int:
        """Remove every removable object; returns how many went."""
        self.locations.clear()
        return self.rpc.call("remove_all", RegexReq(self.config.client_id, "", force), int)

    def list_keys(self, prefix: str = "", limit: int | None = None) -> list[str]:
        """The keys of complete objects that start with ``prefix``, in ascending order.

        The master answers in pages (at most ``MAX_LIST_KEYS`` keys and ``MAX_LIST_BYTES``
        bytes each, ``kvplane.store.types``); this call reads pages until it has ``limit`` keys
        (None: every key) or none are left, all within one deadline (``config.timeout``). A key
        put or removed while the pages are read may or may not be listed; every other key is
        listed once. A tenant lists only its own keys.

        Raises:
            InvalidParams: a negative ``limit``.
            InvalidKey: ``prefix`` contains NUL or is longer than a key.
            Unavailable, Timeout: the master could not be reached, or the pages took too long.
        """
        if limit is not None and limit < 0:
            raise InvalidParams(f"limit must be >= 0 or None, not {limit}")
        deadline = Deadline.after(self.config.timeout)
        keys: list[str] = []
        after: str | None = None
        while limit is None or len(keys) < limit:
            want = 0 if limit is None else limit - len(keys)
            rep = self._call("list_keys", ListKeysReq(self.config.client_id, prefix, want, after),
                             ListKeysRep, deadline)
            keys += rep.keys
            if not rep.more or not rep.keys:
                break
            after = rep.keys[-1]
        return keys

    def register_buffer(self, obj: Any, length: int | None = None) -> int:
        """Register user memory for the zero-copy calls; returns its address."""
        return self.engine.register_memory(obj, length).addr

    def unregister_buffer(self, addr: int) -> None:
        self.engine.unregister_memory(addr)

    @property
    def segment_name(self) -> str:
        return self.engine.name

    def close(self) -> None:
        """Stop heartbeating, unmount, and release the engine (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._hb.join(self.config.heartbeat_interval + 1)
        self.duty.close()
        if self.disk is not None:
            self.disk.close()
        self.disk_links.close()
        given = self.spares.close()
        if given:  # space placed for puts that will not come
            try:
                self.rpc.call("put_end", PutEndReq(self.config.client_id, [], [], returns=given),
                              CodesRep, timeout=2.0)
            except KVPlaneError as exc:
                log.debug("giving spares back on close failed: %s", exc)
        if self._segments:
            try:
                self.rpc.call("unmount", MountReq(self.config.client_id, self._segments), int,
                              timeout=2.0)
            except (Timeout, Unavailable, KVPlaneError) as exc:
                log.debug("unmount on close failed: %s", exc)
        self.rpc.close()
        self.engine.close()

    def __enter__(self) -> "StoreClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _raise(result: KVPlaneError | None) -> None:
    if result is not None:
        raise result


def _value(result: Any) -> Any:
    if isinstance(result, KVPlaneError):
        raise result
    return result
