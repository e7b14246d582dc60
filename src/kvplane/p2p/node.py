"""P2PNode: publish named buffers or files, fetch them from every holder, serve what it holds.

A node is one transfer engine (its data listener serves every chunk this node holds) plus a
tracker client and a heartbeat thread. Publishing registers the caller's memory (or maps the
files) with the engine: nothing is copied. Fetching lands chunks straight in the caller's
buffers (or in memory the node allocates), verifies each, and makes the node a holder of every
chunk the moment it arrives. Imports ``kvplane.common``, ``kvplane.transfer``, ``kvplane.p2p``.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import mmap
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvplane.common import envs
from kvplane.common import log as klog
from kvplane.common.auth import client_token
from kvplane.common.errors import Conflict, InvalidArgument, KVPlaneError
from kvplane.p2p import manifest as mf
from kvplane.p2p.client import TrackerClient
from kvplane.p2p.fetch import Fetch, FetchPlan, FetchStats
from kvplane.p2p.planner import STRATEGIES
from kvplane.transfer import TransferEngine
from kvplane.transfer.memory import address_of

log = logging.getLogger(__name__)
Buffers = Mapping[str, Any] | Sequence[tuple[str, Any]]


@dataclass(frozen=True)
class P2PConfig:
    """Configuration of a P2P node.

    Attributes:
        tracker: the tracker's URL (the ``kvplane metadata`` server): ``http://host:port``.
        token: the shared token (tracker and data listener).
        host: address this node's data listener binds and advertises.
        port: data port (0: any free one).
        protocol: transfer protocol to holders: ``auto`` (shm on the same host) or ``tcp``.
        chunk_size: bytes per chunk when publishing.
        parallel: chunks fetched at once.
        strategy: holder choice, ``rarest`` or ``least-loaded``.
        chunk_timeout: seconds one chunk may take before its holder counts as stalled.
        heartbeat: seconds between heartbeats to the tracker.
        timeout: default seconds for a whole ``get``.
        streams: TCP connections per holder.
    """

    tracker: str = "http://127.0.0.1:8080"
    token: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    protocol: str = "auto"
    chunk_size: int = mf.DEFAULT_CHUNK
    parallel: int = 4
    strategy: str = "rarest"
    chunk_timeout: float = 10.0
    heartbeat: float = 1.0
    timeout: float = 300.0
    streams: int = 2

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise InvalidArgument(f"strategy {self.strategy!r}: one of {STRATEGIES}")
        if self.parallel < 1 or self.chunk_size <= 0 or self.chunk_timeout <= 0:
            raise InvalidArgument("parallel, chunk_size and chunk_timeout must be positive")

    @classmethod
    def from_env(cls, **overrides: Any) -> P2PConfig:
        """Defaults, then KVPLANE_P2P_TRACKER and the token (KVPLANE_TOKEN, else the token file),
        then ``overrides``."""
        base = cls(tracker=envs.get("KVPLANE_P2P_TRACKER"), token=client_token())
        return replace(base, **{k: v for k, v in overrides.items() if v is not None})


@dataclass
class Holding:
    """A version this node serves: its registered regions and what keeps them alive."""

    regions: list[int]
    gold: bool
    keep: list[Any] = field(default_factory=list)


@dataclass
class GetResult:
    """A finished get: the manifest, the items (caller buffers or node-owned arrays), stats."""

    manifest: mf.Manifest
    items: dict[str, Any]
    stats: FetchStats


def describe(obj: Any) -> tuple[str, list[int]]:
    """(dtype, shape) of a tensor, array or plain buffer (plain buffers are uint8 vectors)."""
    if type(obj).__module__.startswith("torch"):
        return str(obj.dtype).removeprefix("torch."), list(obj.shape)
    if isinstance(obj, np.ndarray):
        return str(obj.dtype), list(obj.shape)
    return "uint8", [address_of(obj)[1]]


def as_array(buf: np.ndarray, item: mf.Item) -> np.ndarray:
    """``buf`` (uint8) viewed with the item's dtype and shape where numpy knows the dtype."""
    try:
        dt = np.dtype(item.dtype)
    except TypeError:
        return buf
    n = int(np.prod(item.shape)) if item.shape else 1
    if n * dt.itemsize != item.size:
        return buf
    return buf.view(dt).reshape(item.shape)


class P2PNode:
    """Publishes, fetches and serves named objects (a context manager).

    Args:
        config: a P2PConfig; keyword ``overrides`` replace its fields.
    """

    def __init__(self, config: P2PConfig | None = None, **overrides: Any) -> None:
        cfg = config or P2PConfig.from_env()
        if overrides:
            cfg = replace(cfg, **overrides)
        self.config = cfg
        self.tracker = TrackerClient(cfg.tracker, cfg.token, timeout=10.0)
        self.engine = TransferEngine(host=cfg.host, port=cfg.port, protocol=cfg.protocol,
                                     token=cfg.token, metadata="P2PHANDSHAKE",
                                     streams=cfg.streams, timeout=cfg.chunk_timeout)
        self.name = self.engine.name
        self._lock = threading.RLock()
        self._regions: dict[int, list[Any]] = {}  # addr -> [length, refs]
        self._holdings: dict[tuple[str, int], Holding] = {}
        self._handles: dict[str, int] = {}
        self._reading: dict[tuple[str, int], int] = {}  # fetches in progress (leases to renew)
        self._stop = threading.Event()
        self._closed = False
        self._beat = threading.Thread(target=self._beat_loop, daemon=True, name=f"p2p-beat-{self.name}")
        self._beat.start()

    # -- memory ----------------------------------------------------------------------------
    def _ref(self, obj: Any) -> tuple[int, int]:
        addr, n, _ = address_of(obj)
        with self._lock:
            cur = self._regions.get(addr)
            if cur is not None:
                if cur[0] != n:
                    raise Conflict(f"buffer at {addr:#x} overlaps a registered one of another size")
                cur[1] += 1
                return addr, n
            self.engine.register_memory(obj)
            self._regions[addr] = [n, 1]
        return addr, n

    def _unref(self, addr: int) -> None:
        with self._lock:
            cur = self._regions.get(addr)
            if cur is None:
                return
            cur[1] -= 1
            if cur[1] <= 0:
                del self._regions[addr]
                self.engine.unregister_memory(addr)

    def _register_items(self, items: Sequence[tuple[str, Any]]) -> tuple[list[mf.Item], list[int], list[int]]:
        """Register every non-empty buffer; returns (items, item addresses, registered)."""
        meta, addrs, regs = [], [], []
        try:
            for name, obj in items:
                dtype, shape = describe(obj)
                addr, n, _ = address_of(obj)
                if n:
                    self._ref(obj)
                    regs.append(addr)
                meta.append(mf.Item(name, n, dtype, shape))
                addrs.append(addr)
        except BaseException:
            for a in regs:
                self._unref(a)
            raise
        return meta, addrs, regs

    def _retire_overlapping(self, regions: Sequence[int], keep: tuple[str, int] | None = None) -> None:
        """Stop serving older holdings that use these regions (their bytes are about to change)."""
        with self._lock:
            stale = [k for k, h in self._holdings.items() if k != keep and set(h.regions) & set(regions)]
        for name, version in stale:
            try:
                self.tracker.withdraw(name, self.name, version)
            except KVPlaneError as exc:
                log.warning("withdrawing %s v%d failed: %s", name, version, exc)
            self._drop(name, version)

    # -- publish -----------------------------------------------------------------------------
    def publish(self, name: str, buffers: Buffers, version: int = 0,
                keep: Sequence[Any] = ()) -> int:
        """Publish ``buffers`` (item name -> numpy array, CPU tensor, writable buffer).

        The memory is registered in place, not copied; it must not change while published
        (readers verify every chunk, so a change costs them a refetch, never wrong bytes).

        Args:
            name: object name.
            buffers: the items, in order.
            version: the version number (0: latest + 1).
            keep: objects to keep alive as long as this version is served.

        Returns:
            The version published.

        Raises:
            Conflict: ``version`` is not newer than the latest. InvalidArgument: bad buffers.
        """
        mf.check_name(name)
        pairs = list(buffers.items()) if isinstance(buffers, Mapping) else list(buffers)
        items, addrs, regs = self._register_items(pairs)
        try:
            self._retire_overlapping(regs)
            plan = mf.plan_chunks([i.size for i in items], self.config.chunk_size)
            locs = [addrs[i] + off for i, off, _ in plan]
            with cf.ThreadPoolExecutor(2, thread_name_prefix="p2p-hash") as pool:
                digests = list(pool.map(lambda a: mf.digest(self.engine.memory.view(*a)),
                                        [(loc, n) for loc, (_, _, n) in zip(locs, plan)]))
            m = mf.build(name, version, items, self.config.chunk_size, digests)
            got = self.tracker.publish(m, self.name, locs)
        except BaseException:
            for a in regs:
                self._unref(a)
            raise
        with self._lock:
            self._holdings[(name, got)] = Holding(regs, True, list(keep))
        klog.event("p2p_published", object=name, version=got, size=m.total_size, chunks=len(locs))
        return got

    def publish_files(self, name: str, paths: Sequence[str], version: int = 0) -> int:
        """Publish files (items named by their base names), mapped copy-on-write: no copy."""
        items: list[tuple[str, bytearray | mmap.mmap]] = []
        maps = []
        try:
            for path in paths:
                size = os.path.getsize(path)
                if size == 0:
                    items.append((os.path.basename(path), bytearray()))
                    continue
                with open(path, "rb") as f:
                    mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
                maps.append(mm)
                items.append((os.path.basename(path), mm))
            return self.publish(name, items, version, keep=maps)
        except BaseException:
            for mm in maps:
                try:
                    mm.close()
                except BufferError:
                    pass
            raise

    # -- get -----------------------------------------------------------------------------------
    def get(self, name: str, version: int = 0, out: Buffers | None = None,
            timeout: float | None = None, keep: bool = True, strategy: str | None = None) -> GetResult:
        """Fetch ``name`` (``version``, 0 for the latest) from every holder; verified.

        Args:
            out: item name -> destination buffer (exact size): chunks land there directly.
                Without it the node allocates one array; ``items`` are views of it.
            timeout: seconds for the whole get (default ``config.timeout``).
            keep: keep serving the version afterwards (until it is collected).
            strategy: override ``config.strategy``.

        Raises:
            NotFound: unknown name or version, or a chunk with no live holder.
            Timeout: not done in time. InvalidArgument: ``out`` does not match the manifest.
        """
        m = self.tracker.open(name, self.name, version)
        regs: list[int] = []
        try:
            views, regs, owned = self._destinations(m, out)
            self._retire_overlapping(regs, keep=(m.name, m.version))
            addrs = [views[c.item][0] + c.offset for c in m.chunks]
            plan = FetchPlan(m, self.name, addrs, self.config.parallel,
                             strategy or self.config.strategy, self.config.chunk_timeout)
            stats = self._fetch(plan, self.config.timeout if timeout is None else timeout)
        except BaseException:
            self._abandon(m, regs)
            raise
        self._release(m)
        if keep:
            with self._lock:
                self._holdings[(m.name, m.version)] = Holding(regs, False, owned)
        else:
            self._abandon(m, regs)
        return GetResult(m, {it.name: views[i][1] for i, it in enumerate(m.items)}, stats)

    def _fetch(self, plan: FetchPlan, timeout: float) -> FetchStats:
        """Run one fetch; while it runs, heartbeats renew its lease."""
        key = (plan.manifest.name, plan.manifest.version)
        with self._lock:
            self._reading[key] = self._reading.get(key, 0) + 1
        try:
            return Fetch(self.engine, self.tracker, plan, self._handle, self._forget).run(timeout)
        finally:
            with self._lock:
                self._reading[key] -= 1
                if not self._reading[key]:
                    del self._reading[key]

    def _destinations(self, m: mf.Manifest, out: Buffers | None
                      ) -> tuple[list[tuple[int, Any]], list[int], list[Any]]:
        """(address, object) per item, the registered regions, and node-owned memory."""
        if out is None:
            total = m.total_size
            arena = np.empty(max(total, 1), dtype=np.uint8)
            regs = [self._ref(arena)[0]]
            views, off = [], 0
            for it in m.items:
                buf = as_array(arena[off:off + it.size], it)
                views.append((int(arena.ctypes.data) + off, buf))
                off += it.size
            return views, regs, [arena]
        given = dict(out.items()) if isinstance(out, Mapping) else dict(out)
        if set(given) != {i.name for i in m.items}:
            raise InvalidArgument(f"out has items {sorted(given)}, the manifest "
                                  f"{sorted(i.name for i in m.items)}")
        for it in m.items:
            if address_of(given[it.name])[1] != it.size:
                raise InvalidArgument(f"out[{it.name!r}] is not {it.size} bytes")
        _, addrs, regs = self._register_items([(i.name, given[i.name]) for i in m.items])
        return [(a, given[i.name]) for a, i in zip(addrs, m.items)], regs, []

    def _release(self, m: mf.Manifest) -> None:
        try:
            self.tracker.release(m.name, m.version, self.name)
        except KVPlaneError as exc:
            log.debug("release of %s v%d failed: %s", m.name, m.version, exc)

    def _abandon(self, m: mf.Manifest, regs: list[int]) -> None:
        try:
            self.tracker.withdraw(m.name, self.name, m.version)
        except KVPlaneError:
            pass
        self._release(m)
        for a in regs:
            self._unref(a)

    # -- holdings --------------------------------------------------------------------------
    def withdraw(self, name: str, version: int = 0) -> None:
        """Stop serving ``name`` (one version, or every one with 0): Unregister/DeleteReplica."""
        self.tracker.withdraw(name, self.name, version)
        with self._lock:
            keys = [k for k in self._holdings if k[0] == name and version in (0, k[1])]
        for k in keys:
            self._drop(*k)

    def holdings(self) -> list[tuple[str, int]]:
        """The (name, version) pairs this node serves."""
        with self._lock:
            return sorted(self._holdings)

    def _drop(self, name: str, version: int) -> None:
        with self._lock:
            h = self._holdings.pop((name, version), None)
        if h is None:
            return
        for a in h.regions:
            self._unref(a)
        klog.event("p2p_dropped", object=name, version=version)

    def _handle(self, holder: str, timeout: float) -> int:
        with self._lock:
            h = self._handles.get(holder)
        if h is None:
            h = self.engine.open_segment(holder, timeout)
            with self._lock:
                self._handles[holder] = h
        return h

    def _forget(self, holder: str) -> None:
        with self._lock:
            h = self._handles.pop(holder, None)
        if h is not None:
            self.engine.close_segment(h)

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.config.heartbeat):
            try:
                with self._lock:
                    reading = list(self._reading)
                drop = self.tracker.heartbeat(self.name, self.holdings(), reading,
                                              timeout=max(2.0, self.config.heartbeat * 2))
            except KVPlaneError as exc:
                log.debug("p2p heartbeat failed: %s", exc)
                continue
            for name, version in drop:
                self._drop(name, version)

    # -- tracker views ---------------------------------------------------------------------
    def ls(self, prefix: str = "") -> list[dict[str, Any]]:
        """Published names and their versions."""
        return self.tracker.ls(prefix)

    def rm(self, name: str) -> None:
        """Retire every version of ``name``; each is collected when no reader holds it."""
        self.tracker.rm(name)

    # -- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        """Withdraw everything this node serves, stop heartbeats and the engine (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._beat.join(5)
        for name, version in self.holdings():
            try:
                self.tracker.withdraw(name, self.name, version)
            except KVPlaneError as exc:  # the tracker drops us after holder_ttl anyway
                log.debug("withdraw on close failed: %s", exc)
                break
        self.engine.close()
        self.tracker.close()

    def __enter__(self) -> P2PNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
