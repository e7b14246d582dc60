"""DummyClient: a light store client that holds no segment and no master connection; a
``ClientServer`` on the same host does the work (Mooncake's ``setup_dummy``).

The dummy creates its shared memory (a local buffer for staging, and a memory pool that
``alloc_from_mem_pool`` carves) and attaches it to the server, which maps it; then a put or get
of memory inside those regions moves straight between the dummy's pages and the pool. Memory the
caller registered with ``register_buffer`` (not shared) is staged through the local buffer (one
copy). It offers the part of ``StoreClient``'s API the Mooncake facade uses, with the same
return conventions (per-key lists hold values or exceptions; whole-call failures raise).

Imports the RPC client, the transfer memory table and store types; binds nothing.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np

from kvplane.common.errors import KVPlaneError
from kvplane.common.rpc import RpcClient
from kvplane.store.dummy.types import (
    AttachReq,
    CommitReq,
    GetReq,
    Hello,
    KeysOp,
    LookupRep,
    PatternReq,
    PerKey,
    PutReq,
    RangeOp,
    ReserveReq,
    SessionReq,
    TaskOp,
)
from kvplane.store.errors import InvalidParams, key_error
from kvplane.store.master.allocator import OffsetAllocator
from kvplane.store.replica_types import DescRep, DescResult, TaskCreateRep, TaskId, TaskInfo
from kvplane.store.types import KeyResult, ReplicateConfig
from kvplane.transfer.memory import ManagedBuffer, MemoryTable, Region, address_of, view_at


class _Pool:
    """One attached shared-memory buffer carved by an allocator."""

    def __init__(self, size: int) -> None:
        self.buf = ManagedBuffer(size)
        self.alloc = OffsetAllocator(size)


class _Engine:
    """What the facade reads from ``client.engine``: the memory table."""

    def __init__(self) -> None:
        self.memory = MemoryTable()


class DummyClient:
    """See the module docstring.

    Args:
        server: ``host:port`` of a ``kvplane client-server`` on this host.
        mem_pool_size: bytes of shared memory ``alloc_from_mem_pool`` carves (0: one new
            shared buffer per allocation).
        local_buffer_size: bytes of shared staging for the copying calls.
        token: the server's token.
        timeout: seconds for one call.
    """

    def __init__(self, server: str, mem_pool_size: int, local_buffer_size: int,
                 token: str = "", timeout: float = 30.0) -> None:
        self.session = uuid.uuid4().hex
        self.engine = _Engine()
        self._lock = threading.Lock()
        self._pools: list[_Pool] = []
        self._shared: list[Region] = []
        self.rpc = RpcClient(server, token, timeout)
        try:
            self.segment_name = ""
            self._local = self._attach(local_buffer_size) if local_buffer_size > 0 else None
            self._pool = self._attach(mem_pool_size) if mem_pool_size > 0 else None
            if self._local is None and self._pool is None:
                self.segment_name = self._hello(None).segment
        except BaseException:
            self.close()
            raise
        self.staging = _Staging(self)

    # -- shared memory ------------------------------------------------------------------------------
    def _hello(self, pool: _Pool | None) -> Hello:
        if pool is None:
            return self.rpc.call("hello", SessionReq(self.session), Hello)
        return self.rpc.call("attach", AttachReq(self.session, os.getpid(), pool.buf.name,
                                                 pool.buf.addr, pool.buf.length), Hello)

    def _attach(self, size: int) -> _Pool:
        pool = _Pool(size)
        try:
            self.segment_name = self._hello(pool).segment
        except BaseException:
            pool.buf.close()
            raise
        with self._lock:
            self._pools.append(pool)
        self._shared.append(Region(pool.buf.addr, size, None, kind="shm", shm=pool.buf.name,
                                   keep=pool.buf))
        return pool

    def alloc_from_mem_pool(self, size: int) -> int:
        """An address of ``size`` bytes of shared memory (0 on failure)."""
        if size <= 0:
            return 0
        if self._pool is not None:
            with self._lock:
                off = self._pool.alloc.allocate(size)
            if off is not None:
                return self._pool.buf.addr + off
        try:
            return self._attach(size).buf.addr
        except (KVPlaneError, OSError):
            return 0

    def _is_shared(self, addr: int, size: int) -> bool:
        return any(r.addr <= addr and addr + size <= r.end for r in self._shared)

    @contextmanager
    def _staged(self, addrs: Sequence[int], sizes: Sequence[int],
                copy_in: bool) -> Iterator[tuple[list[int], list[Callable[[], None]]]]:
        """Addresses the server can reach for each (addr, size): shared memory as it is,
        registered private memory through staging (copied in now if ``copy_in``; the returned
        callables copy staged bytes back out)."""
        with ExitStack() as stack:
            out: list[int] = []
            back: list[Callable[[], None]] = []
            for addr, size in zip(addrs, sizes):
                if self._is_shared(addr, size) or size == 0:
                    out.append(addr)
                    continue
                src = self.engine.memory.view(addr, size)  # AddressNotRegistered if private+unknown
                saddr, sview = stack.enter_context(self.staging.block(size))
                if copy_in:
                    sview[:] = np.frombuffer(src, np.uint8)
                out.append(saddr)
                back.append(functools.partial(_copy_back, src, sview))
            yield out, back

    # -- data -----------------------------------------------------------------------------------------
    def _per_key(self, keys: Sequence[str], rep: PerKey, none_ok: bool) -> list[Any]:
        out: list[Any] = []
        for k, c in zip(keys, rep.codes):
            if c < 0:
                out.append(key_error(c, k))
            else:
                out.append(None if none_ok else c)
        return out

    def batch_put_from(self, keys: list[str], addrs: list[int], sizes: list[int],
                       config: ReplicateConfig | None = None, upsert: bool = False) -> list[Any]:
        if not len(keys) == len(addrs) == len(sizes):
            raise InvalidParams("keys, buffers and sizes differ in length")
        with self._staged(addrs, sizes, copy_in=True) as (reach, _):
            rep = self.rpc.call("put", PutReq(self.session, list(keys), reach, list(sizes),
                                              config, upsert), PerKey)
        return self._per_key(keys, rep, none_ok=True)

    def put_batch(self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None,
                  upsert: bool = False) -> list[Any]:
        with ExitStack() as stack:
            addrs = []
            for v in values:
                addr, view = stack.enter_context(self.staging.block(len(v)))
                view[:] = np.frombuffer(v, np.uint8)
                addrs.append(addr)
            return self.batch_put_from(keys, addrs, [len(v) for v in values], config, upsert)

    def put_from(self, key: str, addr: int, size: int, config: ReplicateConfig | None = None) -> None:
        _raise(self.batch_put_from([key], [addr], [size], config)[0])

    def batch_get_into(self, keys: list[str], addrs: list[int], sizes: list[int]) -> list[Any]:
        if not len(keys) == len(addrs) == len(sizes):
            raise InvalidParams("keys, buffers and sizes differ in length")
        with self._staged(addrs, sizes, copy_in=False) as (reach, back):
            rep = self.rpc.call("get_into", GetReq(self.session, list(keys), reach, list(sizes)),
                                PerKey)
            for copy_out in back:
                copy_out()
        return self._per_key(keys, rep, none_ok=False)

    def get_into(self, key: str, addr: int, size: int) -> int:
        return _value(self.batch_get_into([key], [addr], [size])[0])

    def get_batch(self, keys: list[str]) -> list[Any]:
        sizes = self.batch_get_size(keys)
        out: list[Any] = list(sizes)
        hits = [i for i, s in enumerate(sizes) if not isinstance(s, KVPlaneError)]
        with ExitStack() as stack:
            blocks = [stack.enter_context(self.staging.block(sizes[i])) for i in hits]
            got = self.batch_get_into([keys[i] for i in hits], [b[0] for b in blocks],
                                      [sizes[i] for i in hits])
            for i, n, (_, view) in zip(hits, got, blocks):
                out[i] = n if isinstance(n, KVPlaneError) else view[:n].tobytes()
        return out

    def batch_get_size(self, keys: list[str]) -> list[Any]:
        return self._per_key(keys, self.rpc.call("sizes", KeysOp(self.session, list(keys)),
                                                 PerKey), none_ok=False)

    def get_size(self, key: str) -> int:
        return _value(self.batch_get_size([key])[0])

    def batch_exists(self, keys: list[str]) -> list[bool]:
        return [c == 1 for c in self.rpc.call("exists", KeysOp(self.session, list(keys)),
                                              PerKey).codes]

    def batch_remove(self, keys: list[str], force: bool = False) -> list[Any]:
        rep = self.rpc.call("remove", KeysOp(self.session, list(keys), force), PerKey)
        return self._per_key(keys, rep, none_ok=True)

    def remove(self, key: str, force: bool = False) -> None:
        _raise(self.batch_remove([key], force)[0])

    def remove_by_regex(self, pattern: str, force: bool = False) -> int:
        return self.rpc.call("remove_regex", PatternReq(self.session, pattern, force), int)

    def remove_all(self, force: bool = False) -> int:
        return self.rpc.call("remove_all", PatternReq(self.session, "", force), int)

    def register_buffer(self, obj: Any, length: int | None = None) -> int:
        """Make memory usable by the zero-copy calls: shared memory (from the pool) is reached
        by the server directly, other memory is staged; both are bounds-checked by size."""
        addr, n, keep = address_of(obj) if length is None else (int(obj), int(length), None)
        return self.engine.memory.add(Region(addr, n, view_at(addr, n), keep=keep)).addr

    def unregister_buffer(self, addr: int) -> None:
        self.engine.memory.remove(addr)

    def health_check(self, timeout: float = 2.0) -> None:
        self.rpc.call("ping", SessionReq(self.session), int, timeout=timeout)

    # -- replica calls and ranges, as ReplicaOps / Ranges offer them ---------------------------------
    def replica_ops(self) -> _RemoteOps:
        return _RemoteOps(self)

    def ranges(self) -> _RemoteRanges:
        return _RemoteRanges(self)

    def close(self) -> None:
        """Detach from the server and free the shared memory (idempotent)."""
        try:
            self.rpc.call("detach", SessionReq(self.session), int, timeout=2.0)
        except KVPlaneError:
            pass
        self.rpc.close()
        with self._lock:
            pools, self._pools = self._pools, []
        for region in self.engine.memory.regions():
            self.engine.memory.remove(region.addr)
        self._shared = []
        for pool in pools:
            pool.buf.close()


class _Staging:
    """Blocks of the dummy's local buffer (same contract as ``client.staging.Staging``)."""

    def __init__(self, dummy: DummyClient) -> None:
        self._d = dummy

    def take(self, n: int, spill: bool = True) -> tuple[int, np.ndarray, Callable[[], None]] | None:
        pool = self._d._local
        off: int | None = None
        if pool is not None and n > 0:
            with self._d._lock:
                off = pool.alloc.allocate(n)
        if pool is None or off is None:
            if not spill:
                return None
            raise InvalidParams(f"{n} bytes do not fit the dummy's local buffer")
        done, at, alloc = threading.Lock(), off, pool.alloc

        def release() -> None:
            if done.acquire(blocking=False):
                with self._d._lock:
                    alloc.free(at, n)
        return pool.buf.addr + at, pool.buf.array[at:at + n], release

    @contextmanager
    def block(self, n: int) -> Iterator[tuple[int, np.ndarray]]:
        if n == 0:
            yield 0, np.empty(0, np.uint8)
            return
        got = self.take(n)
        if got is None:  # take() with spill raises instead; this keeps the checker honest
            raise InvalidParams(f"{n} bytes do not fit the dummy's local buffer")
        addr, view, release = got
        try:
            yield addr, view
        finally:
            release()


class _RemoteOps:
    """``ReplicaOps`` through the server (tasks run on the server's runner)."""

    def __init__(self, dummy: DummyClient) -> None:
        self.d = dummy

    def batch_get_size(self, keys: list[str]) -> list[Any]:
        return self.d.batch_get_size(keys)

    def descs(self, keys: list[str]) -> list[DescResult]:
        return self.d.rpc.call("descs", KeysOp(self.d.session, list(keys)), DescRep).results

    def clear(self, keys: list[str], segment: str = "") -> list[str]:
        return self.d.rpc.call("clear", KeysOp(self.d.session, list(keys), segment=segment),
                               list[str])

    def create_task(self, kind: str, key: str, targets: list[str], source: str = "") -> TaskCreateRep:
        return self.d.rpc.call("task_create", TaskOp(self.d.session, kind, key, list(targets),
                                                     source), TaskCreateRep)

    def query_task(self, task: TaskId) -> TaskInfo:
        return self.d.rpc.call("task_query", TaskOp(self.d.session, task=task), TaskInfo)

    def close(self) -> None:
        pass


class _RemoteRanges:
    """``Ranges`` through the server; buffers must be shared (or registered: then staged)."""

    def __init__(self, dummy: DummyClient) -> None:
        self.d = dummy

    def lookup(self, keys: Sequence[str]) -> tuple[list[KeyResult], float]:
        t0 = time.monotonic()
        rep = self.d.rpc.call("lookup", KeysOp(self.d.session, list(keys)), LookupRep)
        return rep.results, t0 + rep.lease_left

    def _io(self, result: KeyResult, ranges: Sequence[tuple[int, int, int]], write: bool,
            lease_end: float) -> list[int]:
        addrs, sizes = [r[1] for r in ranges], [r[2] for r in ranges]
        with self.d._staged(addrs, sizes, copy_in=write) as (reach, back):
            req = RangeOp(self.d.session, result,
                          [(off, a, n) for (off, _, n), a in zip(ranges, reach)], write,
                          max(0.0, lease_end - time.monotonic()))
            codes = self.d.rpc.call("range", req, PerKey).codes
            if not write:
                for copy_out in back:
                    copy_out()
        return codes

    def read(self, result: KeyResult, ranges: Sequence[tuple[int, int, int]],
             lease_end: float) -> list[int]:
        return self._io(result, ranges, False, lease_end)

    def write(self, result: KeyResult, ranges: Sequence[tuple[int, int, int]]) -> list[int]:
        return self._io(result, ranges, True, float("inf"))

    def reserve(self, keys: Sequence[str], sizes: Sequence[int],
                cfg: ReplicateConfig | None) -> list[KeyResult]:
        return self.d.rpc.call("reserve", ReserveReq(self.d.session, list(keys), list(sizes), cfg),
                               LookupRep).results

    def commit(self, held: Sequence[tuple[str, KeyResult]]) -> list[int]:
        return self.d.rpc.call("commit", CommitReq(self.d.session, [k for k, _ in held],
                                                   [r for _, r in held]), PerKey).codes

    def revoke(self, held: Sequence[tuple[str, KeyResult]]) -> list[int]:
        return self.d.rpc.call("revoke", CommitReq(self.d.session, [k for k, _ in held],
                                                   [r for _, r in held]), PerKey).codes


def _raise(result: Any) -> None:
    if isinstance(result, KVPlaneError):
        raise result


def _value(result: Any) -> int:
    _raise(result)
    return int(result)


def _copy_back(dst: memoryview, staged: np.ndarray) -> None:
    """Copy a staged block back into the caller's registered memory."""
    dst[:] = staged.data
