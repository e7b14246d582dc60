"""DiskDuty: what a segment node with an SSD tier does (``kvplane segment --disk-dir``).

* **Offload worker** (one named daemon thread): polls the master (``disk_sync``, every 0.1 s
  while there is work, else every 0.25 s) for offload tasks and hands back results, disk copies
  it lost (quota eviction, corrupt files) and forgets. An offload copies the allocation
  ``[header][value]`` out of this segment's memory into a private buffer, checks it (the header
  names the task's key and version under a valid tag, the value matches the checksum: space that
  was freed and reused in the meantime is never written to disk), and writes it crash-safely
  (``layout.write_atomic``).
* **Read-through** (``load``, served on this node's disk RPC port to the service token and the
  tenants' tokens): a reader that found only disk copies asks their owner for them, each key
  (as the master stores it, tenant-scoped) with the ticket the master listed it with; a key
  without a valid ticket is answered as missing, so a tenant reads only what the master gave
  it. Every file is verified as it is read
  (length, footer, tag, key, version, checksum); one that fails is deleted and reported lost,
  never served. Values up to ``INLINE_BUDGET`` per reply come back in the reply itself and are
  promoted into memory in the background (promotion on hit); larger ones are promoted first:
  the owner asks the master for an allocation in its own segment (``promote_start``), reads
  the file into it under the allocation's fence (like a listener WRITE), writes the new
  generation into the header, and reports (``promote_end``); the reader then reads the new
  memory replica as usual.
* **Re-adoption**: after every mount, the files on disk are re-registered (``disk_adopt``).

Built from the client's ``ClientContext`` (the transfer fence is its engine's); imports the
client's ``context`` layer, ``store.disk`` and the tier wire types, never the facade.
"""

from __future__ import annotations

import hmac
import logging
import threading

import numpy as np

from kvplane.common import log as klog
from kvplane.common.auth import ADMIN, Authenticator, Principal
from kvplane.common.errors import KVPlaneError
from kvplane.common.rpc import RpcServer
from kvplane.store import inventory
from kvplane.store.client.context import ClientContext
from kvplane.store.disk import layout
from kvplane.store.disk.store import DiskStore, Entry
from kvplane.store.errors import NoAvailableHandle, ObjectNotFound
from kvplane.store.tier_types import (
    DiskAdoptReq,
    DiskSyncRep,
    DiskSyncReq,
    LoadRep,
    LoadReq,
    OffloadResult,
    OffloadTask,
    PromoteEndReq,
    PromoteRep,
    PromoteReq,
    ticket_of,
)
from kvplane.store.types import SegmentInfo

log = logging.getLogger(__name__)
BUSY_POLL = 0.1
IDLE_POLL = 0.25
ADOPT_BATCH = 2048
INLINE_BUDGET = 8 << 20  # bytes of values one read-through reply carries inline
PROMOTE_QUEUE = 256  # promotions waiting for the worker (more are dropped: reads still work)


class DiskDuty:
    """The SSD tier of one segment node."""

    def __init__(self, ctx: ClientContext) -> None:
        cfg = ctx.config
        self._c = ctx
        # the files are indexed at the first mount, under the master's tag key (its answer)
        self.store = DiskStore(cfg.disk_dir, cfg.disk_size, None, direct=cfg.disk_direct)
        self._stop = threading.Event()
        self._done: list[OffloadResult] = []
        self._promote_lock = threading.Lock()
        self._later: dict[str, tuple[Entry, bytearray]] = {}
        self._wake = threading.Event()
        self.offloaded = 0
        self.promoted = 0
        self.rpc = RpcServer(cfg.local_hostname, 0, authenticate=_members(cfg.token,
                                                                          cfg.peer_tokens),
                             listen=False)  # open once "load" is served
        self.rpc.add("load", self._load, LoadReq)
        self.rpc.start()
        self._thread = threading.Thread(target=self._work, daemon=True,
                                        name=f"store-disk-{cfg.client_id[:8]}")

    def describe(self, info: SegmentInfo) -> None:
        """Advertise the tier in the segment's mount record."""
        info.disk_size = self.store.quota
        info.disk_endpoint = f"{self.rpc.host}:{self.rpc.port}"
        info.write_through = self._c.config.disk_write_through

    def mounted(self, epoch: int, secret: bytes) -> None:
        """After every mount: index the files under the master's tag key ``secret`` (it keys
        the headers the master builds, and the read tickets), note the epoch, re-register the
        files, start the worker."""
        self.store.open(secret)
        self.store.note_epoch(epoch)
        self._adopt()
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()

    def _adopt(self) -> None:
        items = self.store.records()
        seg = self._c.segments[0]
        taken = 0
        for start in range(0, len(items), ADOPT_BATCH):
            batch = items[start:start + ADOPT_BATCH]
            got = self._c.rpc.call("disk_adopt", DiskAdoptReq(
                self._c.config.client_id, seg.name, [r for r, _ in batch], [p for _, p in batch],
                self.store.history), list[int])
            for (rec, _), ok in zip(batch, got):
                if ok:
                    taken += 1
                else:
                    self.store.remove(rec.key, rec.version)
        if items:
            klog.event("store_disk_adopted", segment=seg.name, files=len(items), adopted=taken)

    # -- offload worker ----------------------------------------------------------------------
    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                self._promote_queued()
                busy = self._sync()
            except KVPlaneError as exc:
                log.debug("disk sync failed: %s", exc)
                busy = False
            self._wake.wait(BUSY_POLL if busy else IDLE_POLL)
            self._wake.clear()

    def _sync(self) -> bool:
        done, self._done = self._done, []
        lost = self.store.take_lost()
        try:
            rep = self._c.rpc.call("disk_sync", DiskSyncReq(self._c.config.client_id, done, lost),
                                   DiskSyncRep, timeout=5.0)
        except KVPlaneError:
            self._done = done + self._done
            self.store.lost = lost + self.store.lost
            raise
        for result, taken in zip(done, rep.taken):
            if result.ok and not taken:
                self.store.remove(result.key, result.version)
        for key, version in rep.forgets:
            self.store.remove(key, version)
        for task in rep.offloads:
            if self._stop.is_set():
                break
            self._done.append(self._offload(task))
        return bool(rep.offloads or done)

    def _offload(self, task: OffloadTask) -> OffloadResult:
        image = bytearray(task.hdr + task.size)
        try:
            image[:] = self._c.engine.memory.view(task.addr, task.hdr + task.size)
            rec = inventory.Record(0, task.hdr, task.key, task.version, task.gen, task.size,
                                   task.checksum)
            layout.check(memoryview(image), rec, self.store.secret, task.key)
        except (KVPlaneError, ValueError) as exc:  # freed and reused meanwhile, or unmapped
            log.debug("offload of %r skipped: %s", task.key, exc)
            return OffloadResult(task.key, task.version, False)
        head = layout.parse_header(bytes(image[:task.hdr]), self.store.secret)
        path = self.store.put(head, memoryview(image))
        if path is None:
            return OffloadResult(task.key, task.version, False)
        self.offloaded += 1
        return OffloadResult(task.key, task.version, True, path)

    # -- read-through ----------------------------------------------------------------------------
    def _load(self, req: LoadReq) -> LoadRep:
        """Serve ``keys`` from disk: small values inline in the reply (and promoted into memory
        in the background), larger ones promoted into memory first (see the module docstring)."""
        codes = [0] * len(req.keys)
        data = [b""] * len(req.keys)
        seg = self._c.segments[0].name
        tickets = req.tickets or [b""] * len(req.keys)
        entries = [self.store.entry(k, v) if hmac.compare_digest(
            t, ticket_of(self.store.secret, k, v, seg)) else None
                   for k, v, t in zip(req.keys, req.versions, tickets, strict=True)]
        budget = INLINE_BUDGET if req.inline else 0
        large = []
        for i, e in enumerate(entries):
            if e is None:
                codes[i] = ObjectNotFound.code
            elif e.rec.size <= budget:
                image = self._inline(e, i, codes, data)
                if image is not None:
                    budget -= e.rec.size
                    self._promote_later(e, image)
            else:
                large.append(i)
        if large:
            sure = [e for e in (entries[i] for i in large) if e is not None]  # (all of them)
            for i, code in zip(large, self._promote(sure)):
                codes[i] = code
            # memory at the eviction watermark refused them (``DiskTier.promote_start``):
            # served from disk, inline, within a budget of its own (at least one)
            budget = INLINE_BUDGET if req.inline else 0
            for i in large:
                e = entries[i]
                if codes[i] == NoAvailableHandle.code and e is not None and (
                        e.rec.size <= budget or budget == INLINE_BUDGET):
                    codes[i] = 0
                    if self._inline(e, i, codes, data) is not None:
                        budget -= e.rec.size
        return LoadRep(codes, data)

    def _inline(self, e: Entry, i: int, codes: list[int], data: list[bytes]) -> bytearray | None:
        """Read ``e`` for an inline answer at index ``i``; its image, or None (corrupt)."""
        image = bytearray(e.rec.hdr + e.rec.size)
        try:
            self.store.read_into(e, memoryview(image))
        except layout.Corrupt as exc:
            log.warning("disk tier: %s", exc)
            codes[i] = layout.Corrupt.code
            return None
        data[i] = bytes(memoryview(image)[e.rec.hdr:])
        return image

    def _promote_later(self, e: Entry, image: bytearray) -> None:
        """Queue a promotion of a value just read (promotion on hit, off the reader's path)."""
        with self._promote_lock:
            if len(self._later) < PROMOTE_QUEUE and e.rec.key not in self._later:
                self._later[e.rec.key] = (e, image)
        self._wake.set()

    def _promote(self, entries: list[Entry], images: list[bytearray] | None = None) -> list[int]:
        """Read ``entries`` into allocations of this segment (or copy their ``images``);
        per entry 0 (in memory now), 1 (busy) or an error code."""
        rep = self._c.rpc.call("promote_start", PromoteReq(
            self._c.config.client_id, [e.rec.key for e in entries],
            [e.rec.version for e in entries]), PromoteRep)
        codes, keys, gens, oks = [], [], [], []
        for j, (e, task) in enumerate(zip(entries, rep.tasks)):
            if task.code != 0:
                codes.append(task.code)
                continue
            ok = self._read_in(e, task.addr, task.gen, images[j] if images else None)
            keys.append(e.rec.key)
            gens.append(task.gen)
            oks.append(ok)
            codes.append(0 if ok else layout.Corrupt.code)
        if keys:
            self._c.rpc.call("promote_end", PromoteEndReq(self._c.config.client_id, keys,
                                                          gens, oks), int)
        return codes

    def _promote_queued(self) -> None:
        with self._promote_lock:
            later, self._later = list(self._later.values()), {}
        if later:
            self._promote([e for e, _ in later], [img for _, img in later])

    def _read_in(self, e: Entry, addr: int, gen: int, image: bytearray | None) -> bool:
        fence = self._c.engine.fence
        if not fence.begin_write(gen):
            return False
        try:
            n = e.rec.hdr + e.rec.size
            dest = self._c.engine.memory.view(addr, n)
            if image is None:
                self.store.read_into(e, dest)
            else:
                dest[:] = image
            inventory.restamp(np.frombuffer(dest, np.uint8), 0, gen)
            self.promoted += 1
            return True
        except layout.Corrupt as exc:
            log.warning("disk tier: %s", exc)
            return False
        finally:
            fence.end_write(gen)

    def close(self) -> None:
        """Stop the worker and the disk RPC server (idempotent)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
        self.rpc.close()


def _members(token: str, peers: tuple[str, ...]) -> Authenticator:
    """The disk RPC's check: the service token or a tenant's (reads also need a ticket)."""
    if not token:
        return lambda _given: ADMIN
    wanted = [t.encode() for t in (token, *peers) if t]

    def check(given: str) -> Principal | None:
        raw = given.encode()
        ok = False
        for want in wanted:  # no early exit
            ok |= hmac.compare_digest(raw, want)
        return ADMIN if ok else None
    return check
