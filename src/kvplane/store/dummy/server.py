"""The real side of the dummy/real client split (Mooncake's ``mooncake_client``): one
``StoreClient`` that contributes a segment and holds the master connection, serving dummy
clients on the same host over RPC (``kvplane client-server``).

A dummy attaches its shared memory (``AttachReq``); this process maps it and registers it with
its own engine, so the bytes of a dummy's put or get move between the dummy's memory and the
pool directly, never through the RPC. Requests name the dummy's own addresses; they are mapped
through the dummy's attached regions (an address outside them is INVALID_PARAMS). A dummy whose
process is gone is detached (its mappings dropped) by a liveness pass every second.

The only module of ``kvplane.store.dummy`` that binds sockets.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvplane.common import log as klog
from kvplane.common.errors import KVPlaneError
from kvplane.common.rpc import RpcServer
from kvplane.store.client.client import StoreClient
from kvplane.store.client.ranges import Ranges
from kvplane.store.client.replica_ops import ReplicaOps
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
from kvplane.store.errors import InvalidParams
from kvplane.store.replica_types import DescRep, TaskCreateRep, TaskInfo
from kvplane.transfer.memory import SHM_DIR, SHM_PREFIX

log = logging.getLogger(__name__)
LIVENESS = 1.0  # seconds between checks that attached dummies are alive
UNMAP_AFTER = 30.0  # seconds a detached dummy's memory stays mapped (longer than a transfer)


@dataclass
class _Region:
    dummy: int
    local: int
    size: int
    mapping: mmap.mmap
    array: np.ndarray


@dataclass
class _Session:
    pid: int
    regions: list[_Region] = field(default_factory=list)


def _codes(results: list[Any]) -> PerKey:
    out = []
    for r in results:
        if isinstance(r, KVPlaneError):
            out.append(r.code)
        elif isinstance(r, bool):
            out.append(int(r))
        else:
            out.append(r or 0)
    return PerKey(out)


class ClientServer:
    """Serve dummies on ``host:port`` with ``client`` (which this object then owns).

    Args:
        client: the real client (usually with ``global_segment_size`` > 0).
        host: bind address; dummies must share this host (shared memory).
        port: RPC port (Mooncake's 50052; 0 picks one).
        token: the token dummies present (as for every kvplane RPC).
    """

    def __init__(self, client: StoreClient, host: str = "127.0.0.1", port: int = 0,
                 token: str = "") -> None:
        self.client = client
        self.ops = ReplicaOps(client)
        self.ranges = Ranges(client)
        self._sessions: dict[str, _Session] = {}
        self._unmap: list[tuple[float, list[_Region]]] = []
        self._lock = threading.Lock()
        self.rpc = RpcServer(host, port, token)
        self.port = self.rpc.port
        for name, fn, typ in (
            ("attach", self._attach, AttachReq), ("detach", self._detach, SessionReq),
            ("hello", self._hello, SessionReq), ("ping", self._ping, SessionReq),
            ("sessions", self._count, SessionReq),
            ("put", self._put, PutReq),
            ("get_into", self._get_into, GetReq), ("sizes", self._sizes, KeysOp),
            ("exists", self._exists, KeysOp), ("remove", self._remove, KeysOp),
            ("remove_regex", self._remove_regex, PatternReq),
            ("remove_all", self._remove_all, PatternReq), ("descs", self._descs, KeysOp),
            ("clear", self._clear, KeysOp), ("task_create", self._task_create, TaskOp),
            ("task_query", self._task_query, TaskOp), ("lookup", self._lookup, KeysOp),
            ("range", self._range, RangeOp), ("reserve", self._reserve, ReserveReq),
            ("commit", self._commit, CommitReq), ("revoke", self._revoke, CommitReq),
        ):
            self.rpc.add(name, fn, typ)
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._liveness, name="client-server-liveness",
                                       daemon=True)
        self._watch.start()
        klog.event("client_server_started", port=self.port, segment=client.segment_name)

    # -- sessions ---------------------------------------------------------------------------------
    def _attach(self, req: AttachReq) -> Hello:
        if not req.shm.startswith(SHM_PREFIX) or "/" in req.shm or req.size <= 0:
            raise InvalidParams(f"bad shared-memory name {req.shm!r}")
        fd = os.open(os.path.join(SHM_DIR, req.shm), os.O_RDWR)
        try:
            if os.fstat(fd).st_size < req.size:
                raise InvalidParams(f"{req.shm} is smaller than {req.size} bytes")
            mapping = mmap.mmap(fd, req.size)
        finally:
            os.close(fd)
        array = np.frombuffer(mapping, np.uint8, req.size)
        local = int(array.ctypes.data)
        self.client.engine.register_memory(local, req.size, publish=False)
        with self._lock:
            sess = self._sessions.setdefault(req.session, _Session(req.pid))
            sess.regions.append(_Region(req.addr, local, req.size, mapping, array))
        return Hello(self.client.segment_name)

    def _detach(self, req: SessionReq) -> int:
        with self._lock:
            sess = self._sessions.pop(req.session, None)
        if sess is not None:
            self._release(sess)
        return 0

    def _release(self, sess: _Session, now: bool = False) -> None:
        """Unregister a session's regions; unmap them after ``UNMAP_AFTER`` (a transfer that
        was already running for that dummy must never touch unmapped memory)."""
        for r in sess.regions:
            try:
                self.client.engine.unregister_memory(r.local, publish=False)
            except KVPlaneError:
                pass
        with self._lock:
            self._unmap.append((time.monotonic() + (0 if now else UNMAP_AFTER), sess.regions))
        self._unmap_due(force=now)

    def _unmap_due(self, force: bool = False) -> None:
        with self._lock:
            due = [rs for t, rs in self._unmap if force or t <= time.monotonic()]
            self._unmap = [(t, rs) for t, rs in self._unmap if not (force or t <= time.monotonic())]
        for regions in due:
            for r in regions:
                del r.array
                try:
                    r.mapping.close()
                except BufferError:  # still exported somewhere: the GC unmaps it later
                    pass

    def _hello(self, req: SessionReq) -> Hello:
        return Hello(self.client.segment_name)

    def _count(self, req: SessionReq) -> int:
        """How many dummies are attached (for operators and tests)."""
        with self._lock:
            return len(self._sessions)

    def _ping(self, req: SessionReq) -> int:
        self.client.health_check()
        return 0 if req.session in self._sessions else 1

    def _liveness(self) -> None:
        while not self._stop.wait(LIVENESS):
            with self._lock:
                dead = [s for s, sess in self._sessions.items() if not _alive(sess.pid)]
                gone = [self._sessions.pop(s) for s in dead]
            for sess in gone:
                self._release(sess)
                klog.event("dummy_detached", pid=sess.pid)
            self._unmap_due()

    def _local(self, session: str, addr: int, size: int) -> int:
        with self._lock:
            sess = self._sessions.get(session)
            regions = list(sess.regions) if sess else []
        for r in regions:
            if r.dummy <= addr and addr + size <= r.dummy + r.size:
                return r.local + (addr - r.dummy)
        raise InvalidParams(f"address {addr:#x}+{size} is not in this dummy's shared memory")

    def _locals(self, session: str, addrs: list[int], sizes: list[int]) -> list[int]:
        return [self._local(session, a, n) for a, n in zip(addrs, sizes, strict=True)]

    # -- data -----------------------------------------------------------------------------------------
    def _put(self, req: PutReq) -> PerKey:
        addrs = self._locals(req.session, req.addrs, req.sizes)
        return _codes(self.client.batch_put_from(req.keys, addrs, req.sizes, req.config,
                                                 req.upsert))

    def _get_into(self, req: GetReq) -> PerKey:
        addrs = self._locals(req.session, req.addrs, req.sizes)
        return _codes(self.client.batch_get_into(req.keys, addrs, req.sizes))

    def _sizes(self, req: KeysOp) -> PerKey:
        return _codes(self.ops.batch_get_size(req.keys))

    def _exists(self, req: KeysOp) -> PerKey:
        return _codes(self.client.batch_exists(req.keys))

    def _remove(self, req: KeysOp) -> PerKey:
        return _codes(self.client.batch_remove(req.keys, req.force))

    def _remove_regex(self, req: PatternReq) -> int:
        return self.client.remove_by_regex(req.pattern, req.force)

    def _remove_all(self, req: PatternReq) -> int:
        return self.client.remove_all(req.force)

    # -- replicas and tasks ---------------------------------------------------------------------------
    def _descs(self, req: KeysOp) -> DescRep:
        return DescRep(self.ops.descs(req.keys))

    def _clear(self, req: KeysOp) -> list[str]:
        return self.ops.clear(req.keys, req.segment)

    def _task_create(self, req: TaskOp) -> TaskCreateRep:
        return self.ops.create_task(req.kind, req.key, req.targets, req.source)

    def _task_query(self, req: TaskOp) -> TaskInfo:
        if req.task is None:
            raise InvalidParams("no task id")
        return self.ops.query_task(req.task)

    # -- ranges -----------------------------------------------------------------------------------------
    def _lookup(self, req: KeysOp) -> LookupRep:
        results, lease_end = self.ranges.lookup(req.keys)
        return LookupRep(results, max(0.0, lease_end - time.monotonic()))

    def _range(self, req: RangeOp) -> PerKey:
        ranges = [(off, self._local(req.session, addr, size), size)
                  for off, addr, size in req.ranges]
        if req.write:
            return PerKey(self.ranges.write(req.result, ranges))
        return PerKey(self.ranges.read(req.result, ranges, time.monotonic() + req.lease_end_in))

    def _reserve(self, req: ReserveReq) -> LookupRep:
        return LookupRep(self.ranges.reserve(req.keys, req.sizes, req.config), 0.0)

    def _commit(self, req: CommitReq) -> PerKey:
        return PerKey(self.ranges.commit(list(zip(req.keys, req.results))))

    def _revoke(self, req: CommitReq) -> PerKey:
        return PerKey(self.ranges.revoke(list(zip(req.keys, req.results))))

    # -- lifecycle ----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop serving, drop every dummy's mappings, close the real client (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self.rpc.close()
        self._watch.join(LIVENESS + 1)
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), {}
        self.ops.close()
        self.client.close()  # no transfer runs past this: now the mappings can go
        for sess in sessions:
            self._release(sess, now=True)
        self._unmap_due(force=True)

    def __enter__(self) -> ClientServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
