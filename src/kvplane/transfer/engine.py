"""TransferEngine: registered memory, segments, batches, and the public transfer calls.

Owns the data listener (``server.DataServer``), the memory table, the open segments, the
batch table and the engine's :class:`~kvplane.transfer.plugins.TransportSet`. Planning and
running batches is ``engine_route``; the item paths (``read_many`` and the one-item calls) are
``engine_items``. Blocking calls take ``timeout``; a dead or stalled peer becomes FAILED or
TIMEOUT, never a hang.

Talks to transports only through the seam (``kvplane.transfer.seam``) and the capabilities a
``TransportSet`` discovered; must not import any ``kvplane.transfer.transports`` module nor
name a transport (tests/unit/test_layering.py checks the imports).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import dataclasses
import itertools
import logging
import os
import re
import threading
from collections.abc import Sequence
from typing import Any

from kvplane.common import log as klog
from kvplane.common.config import parse_hostport
from kvplane.common.deadline import Deadline
from kvplane.common.errors import InvalidArgument, KVPlaneError, NotFound, Unavailable
from kvplane.transfer.batch import Batch, raise_first
from kvplane.transfer.config import EngineConfig
from kvplane.transfer.engine_items import ItemPaths, count_done
from kvplane.transfer.engine_route import Router
from kvplane.transfer.fabric import FabricChoice
from kvplane.transfer.fabric import record as record_fabric
from kvplane.transfer.fence import FENCE_BYTES
from kvplane.transfer.jobs import ItemLike, Peer
from kvplane.transfer.memory import ManagedBuffer, MemoryTable, Region, buffer_of, sweep_stale_shm, view_at
from kvplane.transfer.metadata import KEY_PREFIX, MetadataBackend, open_metadata
from kvplane.transfer.plugins import TransportSet
from kvplane.transfer.seam import ControlChannel, RegistersMemory, Route, Transport, TransportContext
from kvplane.transfer.segments import OpenSegment, check_name, decode_desc, encode_desc, host_identity
from kvplane.transfer.server import DataServer
from kvplane.transfer.staging import DeviceLanes
from kvplane.transfer.types import (
    OpCode,
    RegionKind,
    SegmentDesc,
    TaskStatus,
    TransferRequest,
    TransferStatus,
)

log = logging.getLogger(__name__)
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")


class TransferEngine:
    """Moves bytes between registered memory of any processes, in batches.

    Args:
        config: an EngineConfig; keyword ``overrides`` replace its fields.

    Example:
        >>> with TransferEngine(metadata="P2PHANDSHAKE") as te:  # doctest: +SKIP
        ...     te.register_memory(buf)
        ...     seg = te.open_segment("127.0.0.1:15001")
        ...     te.transfer([TransferRequest(OpCode.WRITE, src, seg, remote_addr, n)])
    """

    def __init__(self, config: EngineConfig | None = None, **overrides: Any) -> None:
        cfg = config or EngineConfig.from_env()
        if overrides:
            cfg = dataclasses.replace(cfg, **overrides)
        self.config = cfg
        sweep_stale_shm()
        self.memory = MemoryTable()
        self.host_id = host_identity()
        self._version = 0
        self._lock = threading.Lock()
        self._lanes = DeviceLanes(  # device staging: registered here, never published
            lambda b: self._add(Region(b.addr, b.length, view_at(b.addr, b.length), keep=b.obj)),
            lambda r: self._remove(r.addr), cfg.device_chunk, cfg.device_slots)
        self._server = DataServer(self.memory, self._describe_bytes, cfg.host, cfg.port, cfg.token,
                                  cfg.max_frame, cfg.max_connections, extra_tokens=cfg.extra_tokens,
                                  require_grants=cfg.grants, lanes=self._lanes)
        self.port = self._server.port
        self.fence = self._server.fence  # store generations this engine's listener refuses
        self.grants = self._server.grants  # what tenants' connections may touch (store segments)
        self.transports: dict[str, Transport] = {}  # by registry name (the plugins' own objects)
        try:  # a failed start leaves no listener or transport behind
            self.name = check_name(cfg.name or f"{cfg.host}:{self.port}")
            self._plugins = self._open_transports(cfg)
            self.transports = self._plugins.by_name
            self._meta: MetadataBackend | None = open_metadata(cfg.metadata, cfg.token)
        except BaseException:
            self._abort_start()
            raise
        self._segments: dict[int, OpenSegment] = {}
        self._by_name: dict[str, int] = {}
        self._handles = itertools.count(1)
        self._batches: dict[int, Batch] = {}
        self._batch_ids = itertools.count(1)
        self._managed: dict[int, ManagedBuffer] = {}
        self._exec = cf.ThreadPoolExecutor(8, thread_name_prefix="te-batch")
        self._router = Router(self._plugins, self.memory, self.segment, cfg.protocol,
                              cfg.slice_size, self._exec, self._lanes)
        self._items = ItemPaths(self._router, self.memory, self._segments,
                                lambda reqs, left: self.transfer(reqs, left))
        self._stop = threading.Event()
        self._closed = False
        self._republisher: threading.Thread | None = None
        if self._meta is not None:
            self._start_publishing(self._meta)
        record_fabric(cfg.fabric)
        klog.event("engine_started", segment=self.name, port=self.port, metadata=cfg.metadata,
                   protocol=cfg.fabric.protocol, requested=cfg.fabric.requested)

    @property
    def fabric(self) -> FabricChoice:
        """What this engine's requested protocol resolved to (``kvplane.transfer.fabric``)."""
        return self.config.fabric

    @property
    def transports_loaded(self) -> tuple[str, ...]:
        """Registry names of the transports this engine loaded, in load order."""
        return tuple(self.transports)

    def _start_publishing(self, meta: MetadataBackend) -> None:
        """Publish the descriptor and start the republisher; a failed first publish undoes
        the whole start (listener, transports, executor, backend)."""
        try:
            self.publish()
        except BaseException:
            self._closed = True
            self._abort_start()
            self._exec.shutdown(wait=True)
            meta.close()
            raise
        self._republisher = threading.Thread(target=self._republish_loop, daemon=True,
                                             name=f"te-republish-{self.port}")
        self._republisher.start()

    def _open_transports(self, cfg: EngineConfig) -> TransportSet:
        """Load ``cfg.transports`` (InvalidArgument: none has a control channel)."""
        ctx = TransportContext(self.host_id, cfg.token, cfg.slice_size, cfg.streams,
                               cfg.file_root, connect_timeout=cfg.connect_timeout,
                               retries=cfg.retries, segment=self.name, grants=cfg.grants)
        return TransportSet.load(cfg.transports, ctx)

    def _abort_start(self) -> None:
        """Undo a start that failed half way: listener and transports go."""
        self._server.close()
        for t in self.transports.values():
            t.close()

    # -- descriptor and metadata -----------------------------------------------------------
    def describe(self) -> SegmentDesc:
        """This engine's segment descriptor."""
        adverts = {n: a for n, t in self._plugins.registers_by_name.items() if (a := t.advert())}
        return SegmentDesc(self.name, self.config.host, self.port, self.host_id, os.getpid(),
                           sorted(self.transports), self._lanes.public(self.memory.descs()),
                           self._version, adverts)

    def _describe_bytes(self) -> bytes:
        return encode_desc(self.describe())

    def publish(self, timeout: float = 5.0) -> None:
        """Write the descriptor to the metadata backend (no-op under P2PHANDSHAKE)."""
        if self._meta is not None:
            self._meta.put(KEY_PREFIX + self.name, self._describe_bytes(), timeout)

    def _changed(self) -> None:
        with self._lock:
            self._version += 1
        try:
            self.publish()
        except Unavailable as exc:  # the republisher will retry
            log.warning("publishing segment %s failed: %s", self.name, exc)

    def _republish_loop(self) -> None:
        assert self._meta is not None
        while not self._stop.wait(self.config.republish_interval):
            try:
                if self._meta.get(KEY_PREFIX + self.name, timeout=2.0) is None:
                    self.publish(timeout=2.0)
                    klog.event("segment_republished", segment=self.name)
            except Unavailable as exc:
                log.debug("metadata check failed: %s", exc)

    # -- memory ----------------------------------------------------------------------------
    def register_memory(self, obj: Any, length: int | None = None, publish: bool = True,
                        device: str = "") -> Region:
        """Register a buffer (numpy, bytearray, mmap, torch tensor) or a raw address.

        Device memory too: a contiguous torch tensor on a device, or raw device memory as
        ``register_memory((addr, length), device="cuda:0")``. It becomes a region of kind
        "dev" with no host view, which NIXL reaches directly (VRAM) and the host transports
        through host staging (``kvplane.transfer.staging``; docs/transfer.md, "Device
        memory"). A device with no copy path still registers; a staged move fails with why.

        Args:
            obj: the buffer, an ``(address, length)`` tuple, or an int address (then
                ``length`` is required).
            length: bytes, for an int address.
            publish: update the published descriptor; False for memory used only as a local
                source or destination (staging), which saves a metadata write per call.
            device: the device of raw device memory ("" host memory).

        Raises:
            Conflict: overlaps a registered region.
            InvalidArgument: unsupported, read-only or non-contiguous buffer.
        """
        if isinstance(obj, int):
            if not length or length <= 0:
                raise InvalidArgument("register_memory(address, length) needs length > 0")
            addr, n, keep, dev = obj, length, None, device
        else:
            addr, n, keep, dev = buffer_of(obj, device)
        kind, view = (RegionKind.DEVICE, None) if dev else (RegionKind.MEM, view_at(addr, n))
        region = self._add(Region(addr, n, view, kind=kind, keep=keep, device=dev))
        if publish:
            self._changed()
        return region

    def _add(self, region: Region) -> Region:
        """Insert ``region`` and tell the transports that register memory themselves (and, for
        device memory, the device lanes); one that refuses it undoes the insert (its error
        propagates)."""
        self.memory.add(region)
        told: list[RegistersMemory] = []
        try:
            for t in self._plugins.registers:
                t.on_register(region)
                told.append(t)
            if region.kind == RegionKind.DEVICE:
                self._lanes.add_region(region)
        except BaseException:
            for t in told:
                t.on_unregister(region)
            self.memory.remove(region.addr)
            raise
        return region

    def _remove(self, addr: int) -> Region:
        region = self.memory.remove(addr)
        for t in self._plugins.registers:
            t.on_unregister(region)
        if region.kind == RegionKind.DEVICE:
            self._lanes.remove_region(region)
        return region

    def unregister_memory(self, addr: int, publish: bool = True) -> None:
        """Unregister the region starting at ``addr``. Raises NotFound."""
        region = self._remove(addr)
        if region.fd >= 0:
            os.close(region.fd)
        if publish:
            self._changed()

    def allocate_managed_buffer(self, length: int, populate: bool = False,
                                fenced: bool = False) -> ManagedBuffer:
        """Shared-memory backed, registered memory that same-host peers map directly.

        ``populate`` faults every page in now (segments contributed to a pool do this so a put
        never pays the first-touch cost). ``fenced``: the first ``FENCE_BYTES`` become this
        engine's fence words (the floors same-host writers check; the caller must not use
        them)."""
        buf = ManagedBuffer(length, populate)
        try:
            self._add(Region(buf.addr, length, view_at(buf.addr, length), kind=RegionKind.SHM,
                             shm=buf.name, keep=buf, fenced=fenced))
        except BaseException:
            buf.close()
            raise
        if fenced:
            self.fence.attach(view_at(buf.addr, min(FENCE_BYTES, length)))
        self._managed[buf.addr] = buf
        self._changed()
        return buf

    def free_managed_buffer(self, addr: int) -> None:
        """Unregister and release a managed buffer. Raises NotFound."""
        buf = self._managed.pop(addr, None)
        if buf is None:
            raise NotFound(f"no managed buffer at {addr:#x}")
        self._remove(addr)
        self._changed()
        buf.close()

    def register_file(self, name: str, size: int) -> Region:
        """Create (or open) ``name`` under the file root, sized ``size``, as a file region.

        Raises:
            InvalidArgument: no file root configured, or a name that is not a plain file name.
        """
        root = self.config.file_root
        if not root:
            raise InvalidArgument("file segments need file_root (KVPLANE_FILE_ROOT)")
        if not _FILE_NAME.fullmatch(name):
            raise InvalidArgument(f"bad file name {name!r}: plain names only, no paths")
        rootp = os.path.realpath(root)
        path = os.path.realpath(os.path.join(rootp, name))
        if os.path.dirname(path) != rootp:
            raise InvalidArgument(f"{name!r} escapes the file root")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            region = self.memory.add(Region(self.memory.next_file_base(), size, None, kind=RegionKind.FILE,
                                            path=path, fd=fd))
        except BaseException:
            os.close(fd)
            raise
        self._changed()
        return region

    # -- segments --------------------------------------------------------------------------
    def open_segment(self, name: str, timeout: float = 5.0) -> int:
        """Look up a segment and return its handle (cached; re-fetched when asked again).

        Raises:
            NotFound: the metadata backend has no such segment.
            Unavailable: the backend or (P2P) the peer cannot be reached.
        """
        desc = self._fetch(name, timeout)
        with self._lock:
            h = self._by_name.get(name)
            if h is not None:
                self._segments[h].update(desc)
                return h
            h = next(self._handles)
            self._segments[h] = OpenSegment(h, name, desc, desc.host_id == self.host_id)
            self._by_name[name] = h
            return h

    def _fetch(self, name: str, timeout: float) -> SegmentDesc:
        if name == self.name:
            return self.describe()
        if self._meta is not None:
            raw = self._meta.get(KEY_PREFIX + name, timeout)
            if raw is None:
                raise NotFound(f"segment {name!r} is not published")
            return decode_desc(raw)
        host, port = parse_hostport(name)
        return decode_desc(self._plugins.control.describe(Peer(host, port), timeout))

    def close_segment(self, handle: int) -> None:
        """Forget a segment handle."""
        with self._lock:
            seg = self._segments.pop(handle, None)
            if seg is not None:
                self._by_name.pop(seg.name, None)
        self._router.forget(handle)

    def segment(self, handle: int) -> OpenSegment:
        """The open segment for ``handle``. Raises NotFound."""
        seg = self._segments.get(handle)
        if seg is None:
            raise NotFound(f"no open segment with handle {handle}")
        return seg

    def prune(self) -> int:
        """Drop cached same-host mappings of segments whose process has exited; returns how many."""
        return sum(t.prune() for t in self._plugins.prunable)

    def retire(self, handle: int, gens: list[int], timeout: float = 5.0) -> None:
        """Have the listener of segment ``handle`` refuse READs and WRITEs of ``gens`` from
        now on (``Fence.retire``); this engine's own segment retires them in place.

        Raises:
            NotFound: no such handle.
            Unavailable: the segment's listener could not be reached, or refused.
        """
        seg = self.segment(handle)
        if seg.name == self.name:
            self.fence.retire(gens)
            return
        self._listener(seg, "retire generations").retire(seg.peer, gens, timeout)

    def _listener(self, seg: OpenSegment, what: str) -> ControlChannel:
        """The control channel, to reach ``seg``'s listener (Unavailable: it has none)."""
        if seg.desc.port <= 0:
            raise Unavailable(f"segment {seg.name!r} has no listener to {what} at")
        return self._plugins.control

    def grant(self, handle: int, blob: bytes, timeout: float = 5.0) -> bytes:
        """Install grants (``kvplane.transfer.grants``, packed) at the listener of segment
        ``handle``, for the tenant this engine's token is; one status byte per grant (0 kept).

        Raises:
            NotFound: no such handle.
            Unavailable: the segment's listener could not be reached, or refused.
        """
        seg = self.segment(handle)
        return self._listener(seg, "install grants").grant(
            seg.peer, blob, timeout)

    def via_listener(self, handle: int, remote: int, length: int) -> bool:
        """True when a READ of ``[remote, remote+length)`` in segment ``handle`` goes through
        that segment's listener (a transport with ``Capabilities.via_listener``), which checks
        generations against its fence table (retired ones included); shared memory and this
        engine's own memory are copied directly and check only the fence floor."""
        seg = self._segments.get(handle)
        if seg is None:
            return False
        try:
            route = Route(seg.desc, seg.region(remote, length), seg.same_host)
            return self._router.pick(None, route).capabilities.via_listener
        except KVPlaneError:
            return False

    # -- batch API (Mooncake's shape) -------------------------------------------------------
    def allocate_batch(self, capacity: int) -> int:
        """A batch id that can take up to ``capacity`` requests."""
        bid = next(self._batch_ids)
        self._batches[bid] = Batch(bid, capacity)
        return bid

    def _batch(self, batch_id: int) -> Batch:
        b = self._batches.get(batch_id)
        if b is None:
            raise NotFound(f"no batch {batch_id}")
        return b

    def submit(self, batch_id: int, requests: list[TransferRequest],
               timeout: float | None = None) -> None:
        """Start ``requests`` in the background; poll with :meth:`status` or :meth:`wait`.

        Raises:
            InvalidArgument: the batch cannot take that many more requests.
        """
        batch = self._batch(batch_id)
        tasks = batch.add(requests)
        deadline = Deadline.after(self.config.timeout if timeout is None else timeout)
        groups = self._router.plan(tasks)
        batch.on_done(count_done)
        if groups:
            self._exec.submit(self._router.run, groups, deadline, False)

    def status(self, batch_id: int, task_id: int) -> TaskStatus:
        """(status, transferred bytes) of one request of a batch."""
        tasks = self._batch(batch_id).tasks
        if not 0 <= task_id < len(tasks):
            raise InvalidArgument(f"batch {batch_id} has no request {task_id}")
        t = tasks[task_id]
        return TaskStatus(t.status, t.transferred)

    def batch_status(self, batch_id: int) -> list[TransferStatus]:
        """Status of every request in the batch, in submission order."""
        return [t.status for t in self._batch(batch_id).tasks]

    def errors(self, batch_id: int) -> list[str]:
        """The error message of every request ("" where none)."""
        return [t.error for t in self._batch(batch_id).tasks]

    def wait(self, batch_id: int, timeout: float | None = None) -> list[TransferStatus]:
        """Block until every request is terminal or ``timeout``; returns the statuses."""
        self._batch(batch_id).wait(self.config.timeout + 1 if timeout is None else timeout)
        return self.batch_status(batch_id)

    def free_batch(self, batch_id: int) -> None:
        """Release a batch. Raises Conflict while requests are in flight (ERR_BATCH_BUSY)."""
        self._batch(batch_id).check_free()
        self._batches.pop(batch_id, None)

    # -- one-call forms ----------------------------------------------------------------------
    def transfer(self, requests: list[TransferRequest], timeout: float | None = None,
                 check: bool = False) -> list[TransferStatus]:
        """Run ``requests`` to completion on the calling thread (striping uses helpers).

        Args:
            requests: the moves.
            timeout: seconds for the whole call (default: ``config.timeout``).
            check: raise on the first failed request instead of returning statuses.

        Raises:
            Timeout / Unavailable / InvalidArgument: only with ``check=True``.
        """
        batch = Batch(0, max(1, len(requests)))
        tasks = batch.add(requests)
        deadline = Deadline.after(self.config.timeout if timeout is None else timeout)
        self._router.run(self._router.plan(tasks), deadline, inline=True)
        count_done(batch)
        if check:
            raise_first(tasks)
        return [t.status for t in tasks]

    def transfer_one(self, op: OpCode, local: int, handle: int, remote: int, length: int,
                     transport: str | None = None, timeout: float | None = None
                     ) -> TransferStatus:
        """One request, ending as :meth:`transfer` of it would (status, counters), with the
        least Python: a transport with ``RouteOneIO`` (NIXL) runs it along the route cached
        for the segment's previous one, no batch, task or slice built (``Router.one`` says
        when the route is resolved again); else it is :meth:`transfer` of that request."""
        wait = self.config.timeout if timeout is None else timeout
        return self._items.routed(op, local, handle, remote, length, transport, wait)

    def read_many(self, reads: Sequence[ItemLike], timeout: float | None = None
                  ) -> list[TransferStatus]:
        """READs only, each an :class:`~kvplane.transfer.jobs.Item` (or the plain tuple
        ``(handle, local, remote, length, gen)``): the same outcome as :meth:`transfer` of the
        equivalent requests, with less Python per request.

        Reads that a vectored transport (``VectoredIO``) serves skip the batch/slice
        bookkeeping: per peer they go as one job straight into the local views (over TCP:
        READV frames), the peers in parallel. Any other read (same-process memory, shared
        memory, files) goes through :meth:`transfer`. Nothing raises for one read; its status
        says how it ended.
        """
        return self._items.many(OpCode.READ, reads, self._deadline(timeout))

    def read_one(self, handle: int, local: int, remote: int, length: int, gen: int = 0,
                 timeout: float | None = None) -> TransferStatus:
        """One READ, ending as :meth:`read_many` of that one item would (its status, the same
        counters), with the least Python: the transport's one-item path (``OneItemIO``; over
        TCP a plain READ frame) when it has one."""
        return self._items.one(OpCode.READ, (handle, local, remote, length, gen),
                               self._deadline(timeout))

    def write_one(self, handle: int, local: int, remote: int, length: int, gen: int = 0,
                  timeout: float | None = None) -> TransferStatus:
        """One WRITE, ending as :meth:`write_many` of that one item would, with the least
        Python: the transport's one-item path (over TCP a plain WRITE frame)."""
        return self._items.one(OpCode.WRITE, (handle, local, remote, length, gen),
                               self._deadline(timeout))

    def write_many(self, writes: Sequence[ItemLike], timeout: float | None = None
                   ) -> list[TransferStatus]:
        """WRITEs only, items as in :meth:`read_many`; a vectored transport's writes go out
        as one job per peer (over TCP: windows of WRITEV frames, one ``sendmsg`` each)."""
        return self._items.many(OpCode.WRITE, writes, self._deadline(timeout))

    def _deadline(self, timeout: float | None) -> Deadline:
        return Deadline.after(self.config.timeout if timeout is None else timeout)

    async def transfer_async(self, requests: list[TransferRequest],
                             timeout: float | None = None) -> list[TransferStatus]:
        """asyncio form of :meth:`transfer`: awaits completion without blocking the loop."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        bid = self.allocate_batch(max(1, len(requests)))

        def settle() -> None:
            if not fut.done():
                fut.set_result(None)

        def done(_: Batch) -> None:
            loop.call_soon_threadsafe(settle)

        try:
            self.submit(bid, requests, timeout)
            self._batch(bid).on_done(done)
            wait_s = (self.config.timeout if timeout is None else timeout) + 1.0
            await asyncio.wait_for(fut, wait_s)
            return self.batch_status(bid)
        finally:
            if not self._batch(bid).busy:
                self.free_batch(bid)

    def read(self, handle: int, local: int, remote: int, length: int,
             timeout: float | None = None) -> None:
        """Copy remote -> local; raises on failure."""
        self.transfer([TransferRequest(OpCode.READ, local, handle, remote, length)], timeout, True)

    def write(self, handle: int, local: int, remote: int, length: int,
              timeout: float | None = None) -> None:
        """Copy local -> remote; raises on failure."""
        self.transfer([TransferRequest(OpCode.WRITE, local, handle, remote, length)], timeout, True)

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Unpublish, stop the listener and release everything (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._meta is not None:
            try:
                self._meta.delete(KEY_PREFIX + self.name, timeout=2.0)
            except Unavailable:
                pass
            self._meta.close()
        self._server.close()
        self._lanes.close()
        for t in self.transports.values():
            t.close()
        self._exec.shutdown(wait=False, cancel_futures=True)
        for addr in list(self._managed):
            self._managed.pop(addr).close()
        for r in self.memory.regions():
            if r.fd >= 0:
                os.close(r.fd)

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

