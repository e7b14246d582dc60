"""StoreClient: the blocking store client (Mooncake semantics; batch is the primitive).

A put is PutStart (master allocates replicas) -> transfer-engine writes -> PutEnd (or
PutRevoke on failure). A get is GetReplicaList (master grants a read lease) -> a transfer from
the best replica (same host first, through shared memory) -> fail over to the next replica.
Bytes never pass through the master. A client with ``global_segment_size > 0`` contributes a
shared-memory segment to the pool and heartbeats; after a master restart or a leader change it
remounts and re-registers the objects its segment holds (``kvplane.store.host``). The master may be one
``host:port`` or an HA cluster ``etcd://h1:2379;h2:2379`` (``link``: calls follow the leader and
retry within their deadline). Every put writes the object's inventory header (built by the
master) in front of its value in every replica.

Errors: single-key calls raise from the ``kvplane.common.errors`` tree (``ObjectNotFound``,
``TransferFail``, ``NoAvailableHandle``, ``Timeout``...; see docs/errors.md). Batch calls return
one entry per key, where a failed key holds its exception instance instead of a value (as
``asyncio.gather(return_exceptions=True)`` does); a failure of the whole call (master
unreachable, bad arguments) raises. Mooncake's integer codes exist only in ``kvplane.compat``.

Integrity (docs/store.md, "Guarantees"): one deadline per call (``timing``), puts committed only
when the master's PutEnd says so, reads inside the master's lease and checked against the
object's checksum, failed segments reported to the master; a client with a segment also fences
generations and runs re-replication tasks for the master (``host.repairs``).

This module is the facade: it builds the ``ClientContext`` the layers share, and each public call
is a thin step into one layer (``get_path``, ``put_path``, ``lookup``...; the order is
``kvplane.store.client.LAYERS``). It is the only client module that imports the host package.

Why blocking and not asyncio at the core: a store op is two round trips of ~30 us each here, and
an event-loop hop per call costs as much again. The asyncio facade (``aio.AsyncStoreClient``)
runs this core in a thread pool, as Mooncake's async store does.
"""

from __future__ import annotations

import logging
import re
import threading
from contextlib import ExitStack
from typing import Any

import numpy as np

from kvplane.common import log as klog
from kvplane.common.auth import client_token
from kvplane.common.deadline import Deadline
from kvplane.common.errors import KVPlaneError, Timeout, Unauthorized, Unavailable
from kvplane.store.client import get_path, grants, put_path
from kvplane.store.client.context import ClientContext
from kvplane.store.client.link import MasterLink
from kvplane.store.client.location_cache import Locations
from kvplane.store.client.lookup import exists
from kvplane.store.client.replica_io import retire
from kvplane.store.client.spares import Spares
from kvplane.store.client.staging import Staging
from kvplane.store.client.suspects import Retired, Suspects
from kvplane.store.config import StoreConfig
from kvplane.store.errors import InvalidParams, key_error
from kvplane.store.host.adoption import Holdings
from kvplane.store.host.disk_node import DiskDuty
from kvplane.store.host.repairs import SegmentDuty
from kvplane.store.host.segment import FENCE_WORD, contribute
from kvplane.store.shard.host import ShardedHoldings
from kvplane.store.shard.link import ShardedLink, open_link
from kvplane.store.types import (
    CodesRep,
    KeysReq,
    ListKeysRep,
    ListKeysReq,
    MountRep,
    MountReq,
    PingRep,
    PingReq,
    PutEndReq,
    RegexReq,
    RemoveReq,
    ReplicateConfig,
    SegmentInfo,
)
from kvplane.transfer import EngineConfig, TransferEngine

__all__ = ["FENCE_WORD", "StoreClient"]
log = logging.getLogger(__name__)


class StoreClient:
    """A store client. Thread-safe; every call is bounded by ``config.timeout``.

    Args:
        config: a StoreConfig; keyword ``overrides`` replace its fields.
    """

    context: ClientContext  # what the layers share (``kvplane.store.client.context``)
    engine: TransferEngine
    rpc: MasterLink | ShardedLink
    staging: Staging
    suspects: Suspects
    retired: Retired
    locations: Locations
    spares: Spares

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
        self.engine = TransferEngine(EngineConfig.from_env(
            host=cfg.local_hostname, port=cfg.port, metadata=cfg.metadata,
            protocol=cfg.protocol, token=cfg.token, timeout=cfg.timeout,
            extra_tokens=cfg.peer_tokens or None,
            grants=bool(cfg.global_segment_size > 0 and cfg.peer_tokens)))
        self.remounts = 0
        self.disk: DiskDuty | None = None
        rpc: MasterLink | ShardedLink | None = None
        try:
            rpc = open_link(cfg.master, cfg.token, cfg.timeout)  # a ShardedLink for shards
            ctx = ClientContext(cfg, self.engine, rpc, Staging(self.engine, cfg.local_buffer_size))
            self._adopt(ctx)
            if cfg.global_segment_size > 0:
                ctx.segments.append(contribute(ctx))
                if cfg.disk_dir:
                    self.disk = DiskDuty(ctx)
                    self.disk.describe(ctx.segments[0])
            self.mount()
        except BaseException:  # a failed start leaves no listener, thread or shared memory
            if self.disk is not None:
                self.disk.close()
            if rpc is not None:
                rpc.close()
            self.engine.close()
            raise
        # a heartbeat (its call and its answer: remount, fences, forgotten headers, shares
        # re-cut, all writes into the segment's memory) runs under this lock; close() takes it
        # before releasing anything, so a ping that outlived close()'s join (a slow master:
        # at most its 5 s timeout) never writes into memory that is gone
        self._answer_lock = threading.Lock()
        self._released = False
        self._hb = threading.Thread(target=self._heartbeat, daemon=True,
                                    name=f"store-heartbeat-{cfg.client_id[:8]}")
        self._hb.start()

    def _adopt(self, ctx: ClientContext) -> None:
        """Take ``ctx`` as this client's, with the names its callers read."""
        self.context = ctx
        self.rpc, self.staging = ctx.rpc, ctx.staging
        self.suspects, self.retired = ctx.suspects, ctx.retired
        self.locations, self.spares, self.disk_links = ctx.locations, ctx.spares, ctx.disk_links
        self.duty = SegmentDuty(ctx)
        self.holdings = (ShardedHoldings(ctx, ctx.rpc) if isinstance(ctx.rpc, ShardedLink)
                         else Holdings(ctx))

    @property
    def config(self) -> StoreConfig:
        """The configuration every layer reads (replacing it changes theirs too)."""
        return self.context.config

    @config.setter
    def config(self, cfg: StoreConfig) -> None:
        self.context.config = cfg

    @property
    def lease_ttl(self) -> float:
        """The master's read lease, as its last lookup said (seconds)."""
        return self.context.lease_ttl

    @property
    def corrupt_reads(self) -> int:
        """Replica reads whose bytes failed the checksum."""
        return self.context.corrupt_reads

    @property
    def segments(self) -> list[SegmentInfo]:
        """The segments this client contributes (none unless ``global_segment_size > 0``)."""
        return self.context.segments

    # -- liveness ------------------------------------------------------------------------------
    def mount(self) -> None:
        """(Re)register this client and its segments with the master: the master's epoch (and
        floor) become what this segment's listener admits, and the objects the segment already
        holds are re-registered (``host.adoption``)."""
        segments = self.context.segments
        history = self.holdings.history
        rep = self.rpc.call("mount", MountReq(self.config.client_id, segments, history,
                                              adopt=bool(segments and history)), MountRep)
        if self.disk is not None and rep.epoch > 0:  # before the memory records: their last
            self.disk.mounted(rep.epoch, rep.secret)  # batch ends a recovering master's wait
        if segments and rep.epoch > 0:
            self.engine.grants.mounted(rep.secret, [(s.name, s.base, s.size) for s in segments],
                                       rep.tenants)
            self.holdings.mounted(rep)
        if rep.tenant:  # a tenant: never shared memory or same-host paths, only listeners
            grants.tenant_transfers(self.engine)

    def _heartbeat(self) -> None:
        failures = 0
        acks: tuple[list[int], list[int]] = ([], [])
        while any(acks) or not self.context.closed.wait(self.config.heartbeat_interval):
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
        with self._answer_lock:  # (the call too: a sharded ping re-cuts shares in memory)
            if self._released:
                return [], []
            rep = self.rpc.call("ping", PingReq(self.config.client_id, acks,
                                                self.suspects.take(), forgot,
                                                self.retired.take()), PingRep,
                                timeout=min(self.config.timeout, 5.0))
            return self._handle_ping(rep)

    def _handle_ping(self, rep: PingRep) -> tuple[list[int], list[int]]:
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
        if self.context.closed.is_set():
            raise Unavailable("the store client is closed")
        self.rpc.call("ping", PingReq(self.config.client_id), PingRep, timeout=timeout, once=True)

    def segment_handle(self, segment: str, deadline: Deadline | None = None) -> int:
        """The engine's handle of ``segment``, opened once (bounded by ``deadline``)."""
        return self.context.segment_handle(segment, deadline)

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
        return put_path.put_many(self.context, list(keys), [int(a) for a in addrs],
                                 [int(s) for s in sizes], config or ReplicateConfig(), upsert)

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
        ctx = self.context
        got = get_path.get_into(ctx, list(keys), list(map(int, addrs)), list(map(int, sizes)),
                                Deadline.after(ctx.config.timeout))
        return [n if n >= 0 else key_error(n, k) for k, n in zip(keys, got)]

    # -- the rest of the API --------------------------------------------------------------------------
    def put_from(self, key: str, addr: int, size: int, config: ReplicateConfig | None = None) -> None:
        """Store ``size`` bytes at registered ``addr`` under ``key`` (a no-op if it exists)."""
        _raise(self.batch_put_from([key], [addr], [size], config)[0])

    def get_into(self, key: str, addr: int, size: int) -> int:
        """Read ``key`` into a registered buffer; returns the bytes read."""
        addr, size = int(addr), int(size)
        ctx = self.context
        deadline = Deadline.after(ctx.config.timeout)
        if ctx.locations.capacity:
            n = get_path.held_one(ctx, key, addr, size, deadline)
            if n is not None:
                return n
        n = get_path.get_into(ctx, [key], [addr], [size], deadline)[0]
        if n < 0:
            raise key_error(n, key)
        return n

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
        :meth:`batch_get_into` (``get_path``)."""
        ctx = self.context
        return get_path.get_copies(ctx, list(keys), Deadline.after(ctx.config.timeout))

    def get(self, key: str) -> bytes:
        """The bytes stored under ``key``.

        Raises:
            ObjectNotFound: no complete object under ``key``.
            TransferFail: every replica failed to transfer.
        """
        got = self.get_batch([key])[0]
        if isinstance(got, KVPlaneError):
            raise got
        return got

    def batch_exists(self, keys: list[str]) -> list[bool]:
        """Per key, whether a complete object exists (each hit takes a read lease, as in
        Mooncake; this client then holds the places the master names with it: ``lookup``)."""
        ctx = self.context
        return exists(ctx, list(keys), Deadline.after(ctx.config.timeout))

    def exists(self, key: str) -> bool:
        """Whether a complete object exists under ``key``."""
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
        rep = self.context.call("remove", RemoveReq(self.config.client_id, list(keys), force),
                                CodesRep, deadline)
        if rep.retire:  # forced while leased: readers holding the lease must stop now
            retire(self.context, rep.retire, deadline)  # (what fails goes by heartbeat)
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
            rep = self.context.call("list_keys", ListKeysReq(self.config.client_id, prefix, want,
                                                             after), ListKeysRep, deadline)
            keys += rep.keys
            if not rep.more or not rep.keys:
                break
            after = rep.keys[-1]
        return keys

    def register_buffer(self, obj: Any, length: int | None = None) -> int:
        """Register user memory for the zero-copy calls; returns its address."""
        return self.engine.register_memory(obj, length).addr

    def unregister_buffer(self, addr: int) -> None:
        """Unregister memory that :meth:`register_buffer` registered."""
        self.engine.unregister_memory(addr)

    @property
    def segment_name(self) -> str:
        """This client's segment name (its engine's)."""
        return self.engine.name

    def close(self) -> None:
        """Stop heartbeating, unmount, and release the engine (idempotent)."""
        closed = self.context.closed
        if closed.is_set():
            return
        closed.set()
        self._hb.join(self.config.heartbeat_interval + 1)
        with self._answer_lock:  # a ping still out (a slow master) finds nothing to write into
            self._released = True
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
        if self.context.segments:
            try:
                self.rpc.call("unmount", MountReq(self.config.client_id, self.context.segments),
                              int, timeout=2.0)
            except (Timeout, Unavailable, KVPlaneError) as exc:
                log.debug("unmount on close failed: %s", exc)
        self.rpc.close()
        self.engine.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _raise(result: KVPlaneError | None) -> None:
    if result is not None:
        raise result
