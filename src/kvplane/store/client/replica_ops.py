"""A store client's replica calls: sizes, descriptors, replica clear, copy/move tasks.

``ReplicaOps(client)`` adds to a ``StoreClient`` what Mooncake's client has beyond put/get:

* ``batch_get_size``, ``descs`` (replica descriptors; no lease), ``clear`` (BatchReplicaClear);
* ``create_task`` / ``query_task``: a copy or move task queued on the master, then carried out
  by this client's runner thread: ``task_start`` (the master allocates the targets), one read
  of a source replica into local staging, one write to each target, ``task_done``. Each task
  is bounded by ``client.config.timeout``; if this process dies the master fails the task at
  its processing timeout and frees the targets.

Errors: calls raise from the kvplane tree (the master unreachable, a timeout); per-key results
carry codes as the master gave them. Built from a client's context (``ReplicaOps(client)`` takes
anything with a ``context``); imports the transfer engine, store types and ``context``.
"""

from __future__ import annotations

import logging
import queue
import threading

import msgspec
import numpy as np

from kvplane.common.deadline import Deadline
from kvplane.common.errors import KVPlaneError
from kvplane.store.client.context import ContextOwner
from kvplane.store.errors import key_error
from kvplane.store.replica_types import (
    DescRep,
    DescResult,
    ReplicaClearReq,
    TaskCreateRep,
    TaskCreateReq,
    TaskDoneReq,
    TaskId,
    TaskInfo,
    TaskReq,
    TaskWork,
)
from kvplane.store.types import CodesRep, KeysReq, Replica
from kvplane.transfer import OpCode, TransferRequest, TransferStatus

log = logging.getLogger(__name__)


class ReplicaOps:
    """See the module docstring. Thread-safe; ``close()`` stops the runner."""

    def __init__(self, client: ContextOwner) -> None:
        self.c = client.context
        self._queue: queue.Queue[TaskId | None] = queue.Queue()
        self._runner: threading.Thread | None = None
        self._lock = threading.Lock()
        self._handles: dict[str, int] = {}
        self.ran = 0

    # -- queries -------------------------------------------------------------------------------
    def batch_get_size(self, keys: list[str]) -> list[int | KVPlaneError]:
        """Per key its size, or the exception (ObjectNotFound ...)."""
        codes = self.c.rpc.call("get_size", KeysReq(self.c.config.client_id, list(keys)),
                                CodesRep).codes
        return [n if n >= 0 else key_error(n, k) for k, n in zip(keys, codes)]

    def descs(self, keys: list[str]) -> list[DescResult]:
        """Per key its replicas (tier, status, buffer) or a code; takes no lease."""
        return self.c.rpc.call("replica_descs", KeysReq(self.c.config.client_id, list(keys)),
                               DescRep).results

    def clear(self, keys: list[str], segment: str = "") -> list[str]:
        """Clear this client's objects whose leases ended (all replicas, or those on
        ``segment``); returns the keys cleared."""
        return self.c.rpc.call("replica_clear", ReplicaClearReq(self.c.config.client_id,
                                                                list(keys), segment), list[str])

    # -- tasks ---------------------------------------------------------------------------------
    def create_task(self, kind: str, key: str, targets: list[str], source: str = "") -> TaskCreateRep:
        """Queue a copy/move on the master and hand it to this client's runner."""
        rep = self.c.rpc.call("task_create", TaskCreateReq(self.c.config.client_id, kind, key,
                                                           list(targets), source), TaskCreateRep)
        if rep.code == 0:
            self._ensure_runner()
            self._queue.put(rep.task)
        return rep

    def query_task(self, task: TaskId) -> TaskInfo:
        return self.c.rpc.call("task_query", TaskReq(self.c.config.client_id, task), TaskInfo)

    def _ensure_runner(self) -> None:
        with self._lock:
            if self._runner is None:
                self._runner = threading.Thread(
                    target=self._run, daemon=True,
                    name=f"store-tasks-{self.c.config.client_id[:8]}")
                self._runner.start()

    def _run(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                return
            try:
                self._execute(task)
            except KVPlaneError as exc:  # the master fails it at its processing timeout
                log.warning("task %s: %s", task, exc)

    def _execute(self, task: TaskId) -> None:
        cid = self.c.config.client_id
        work = self.c.rpc.call("task_start", TaskReq(cid, task), TaskWork)
        if work.code:
            return
        if work.grants:  # a tenant's task: its grants, before its transfers
            self.c.install_grants(work.grants, Deadline.after(self.c.config.timeout))
        ok, message = self._copy(work)
        self.c.rpc.call("task_done", TaskDoneReq(cid, task, ok, message), int)
        self.ran += 1

    def _copy(self, work: TaskWork) -> tuple[list[bool], str]:
        """Read a source into staging, write every target; per target whether it landed."""
        if not work.targets:
            return [], "ok"
        with self.c.staging.block(work.size) as (addr, _view):
            for source in work.sources:
                if self._move(OpCode.READ, addr, source, work.size):
                    break
            else:
                return [False] * len(work.targets), "no source replica could be read"
            ok = [self._move(OpCode.WRITE, addr, t, work.size) for t in work.targets]
        for i, (target, header) in enumerate(zip(work.targets, work.headers)):
            if ok[i] and header:  # the inventory header goes in once the value landed
                ok[i] = self._write_header(target, header)
        return ok, "ok" if all(ok) else "a target write failed"

    def _write_header(self, target: Replica, header: bytes) -> bool:
        """Write ``header`` into the bytes just before ``target``'s value."""
        n = len(header)
        with self.c.staging.block(n) as (addr, view):
            view[:n] = np.frombuffer(header, dtype=np.uint8)
            return self._move(OpCode.WRITE, addr,
                              msgspec.structs.replace(target, addr=target.addr - n, size=n), n)

    def _move(self, op: OpCode, addr: int, replica: Replica, size: int) -> bool:
        try:
            handle = self._handles.get(replica.segment)
            if handle is None:
                handle = self.c.engine.open_segment(replica.segment,
                                                    timeout=min(self.c.config.timeout, 5.0))
                self._handles[replica.segment] = handle
            status = self.c.engine.transfer(
                [TransferRequest(op, addr, handle, replica.addr, size, gen=replica.gen)],
                self.c.config.timeout)
        except KVPlaneError as exc:
            log.warning("task %s of %s failed: %s", op.name, replica.segment, exc)
            self._handles.pop(replica.segment, None)
            return False
        if status[0] != TransferStatus.COMPLETED:
            self._handles.pop(replica.segment, None)
            return False
        return True

    def close(self) -> None:
        """Stop the runner (it finishes the task at hand)."""
        with self._lock:
            runner, self._runner = self._runner, None
        if runner is not None:
            self._queue.put(None)
            runner.join(self.c.config.timeout + 1)
