"""Batches: per-request state, slices, completion counting. Pure bookkeeping, no I/O.

A request is cut into slices; a request is COMPLETED when all its slices are, FAILED or
TIMEOUT as soon as one slice is. A batch is done when every request is terminal.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvplane.common.errors import Conflict, InvalidArgument
from kvplane.transfer.types import OpCode, TransferRequest, TransferStatus


class Task:
    """One request's state inside a batch."""

    __slots__ = ("req", "status", "pending", "error", "code", "transferred", "batch")

    def __init__(self, req: TransferRequest, batch: Batch) -> None:
        self.req = req
        self.status = TransferStatus.WAITING
        self.pending = 0
        self.error = ""
        self.code = 0
        self.transferred = 0
        self.batch = batch

    def finish_slice(self, status: TransferStatus, nbytes: int = 0, error: str = "") -> None:
        """Record one slice's outcome (thread-safe through the batch lock)."""
        self.batch.finish_slice(self, status, nbytes, error)


class Slice:
    """A contiguous piece of one request, executed by exactly one transport lane.

    Attributes:
        local: writable view of the local bytes (source for WRITE, destination for READ).
        remote: remote address (or file offset inside a file region, for the file transport).
    """

    __slots__ = ("task", "op", "local", "remote", "length")
    device = ""  # host memory (a DeviceSlice names its device)
    addr = 0  # the local address of a DeviceSlice (a host slice's is its view's)

    def __init__(self, task: Task, op: OpCode, local: memoryview, remote: int, length: int) -> None:
        self.task = task
        self.op = op
        self.local = local
        self.remote = remote
        self.length = length

    def done(self, status: TransferStatus, error: str = "") -> None:
        """Report this slice finished with ``status``."""
        task = self.task
        task.batch.finish_slice(task, status, self.length if status == TransferStatus.COMPLETED else 0,
                                error)


class DeviceSlice(Slice):
    """A slice whose local side is device memory, for a transport that moves it by itself
    (``Capabilities.device_kinds``): ``local`` is empty, ``addr`` is the device address on
    ``device``. Never give one to a transport that reads ``local``."""

    __slots__ = ("addr", "device")

    def __init__(self, task: Task, op: OpCode, local: memoryview, remote: int, length: int,
                 addr: int, device: str) -> None:
        super().__init__(task, op, local, remote, length)
        self.addr, self.device = addr, device


def cut(task: Task, local: memoryview, remote: int, length: int, slice_size: int) -> list[Slice]:
    """Cut a request into slices of at most ``slice_size``; a tail under 1/4 merges back."""
    if length <= slice_size:
        return [Slice(task, task.req.op, local, remote, length)]
    out: list[Slice] = []
    off = 0
    while off < length:
        n = min(slice_size, length - off)
        if length - off - n and length - off - n < slice_size // 4:
            n = length - off
        out.append(Slice(task, task.req.op, local[off:off + n], remote + off, n))
        off += n
    return out


class Batch:
    """Up to ``capacity`` requests submitted in one or more calls; polled per request."""

    def __init__(self, batch_id: int, capacity: int) -> None:
        if capacity <= 0:
            raise InvalidArgument("batch capacity must be > 0")
        self.id = batch_id
        self.capacity = capacity
        self.tasks: list[Task] = []
        self._lock = threading.Lock()
        self._open = 0
        self._done: threading.Event | None = None  # made on first wait (the sync path never waits)
        self._callbacks: list[Callable[[Batch], None]] = []

    def add(self, reqs: list[TransferRequest]) -> list[Task]:
        """Append requests as PENDING tasks.

        Raises:
            InvalidArgument: when the batch would exceed its capacity (ERR_TOO_MANY_REQUESTS).
        """
        with self._lock:
            if len(self.tasks) + len(reqs) > self.capacity:
                raise InvalidArgument(f"batch {self.id} holds {self.capacity} requests; "
                                      f"{len(self.tasks)} + {len(reqs)} is too many")
            new = [Task(r, self) for r in reqs]
            for t in new:
                t.status = TransferStatus.PENDING
            self.tasks.extend(new)
            self._open += len(new)
            if new and self._done is not None:
                self._done.clear()
        return new

    def expect(self, task: Task, slices: int) -> None:
        """Declare how many slices ``task`` was cut into (0 finishes it at once)."""
        with self._lock:
            task.pending += slices
        if slices == 0:
            self.finish_slice(task, TransferStatus.COMPLETED, 0, "")

    def finish_slice(self, task: Task, status: TransferStatus, nbytes: int, error: str) -> None:
        """Fold one slice result into its task; fires callbacks when the batch completes."""
        fire = False
        with self._lock:
            if task.status.done:
                return
            task.transferred += nbytes
            task.pending -= 1
            if status != TransferStatus.COMPLETED:
                task.status, task.error = status, error
            elif task.pending <= 0:
                task.status = TransferStatus.COMPLETED
            if task.status.done:
                self._open -= 1
                if self._open == 0:
                    if self._done is not None:
                        self._done.set()
                    fire = True
        if fire and self._callbacks:
            for cb in list(self._callbacks):
                cb(self)

    def fail(self, task: Task, status: TransferStatus, error: str) -> None:
        """Finish a task at once, whatever slices are left (used before slicing)."""
        with self._lock:
            task.pending = 1
        self.finish_slice(task, status, 0, error)

    def on_done(self, cb: Callable[[Batch], None]) -> None:
        """Call ``cb(batch)`` when every task is terminal (at once if already so)."""
        with self._lock:
            self._callbacks.append(cb)
            done = self._open == 0
        if done:
            cb(self)

    def wait(self, timeout: float | None) -> bool:
        """Block until done or ``timeout``; True if done."""
        with self._lock:
            if self._open == 0:
                return True
            if self._done is None:
                self._done = threading.Event()
            done = self._done
        return done.wait(timeout)

    @property
    def busy(self) -> bool:
        return self._open > 0

    def check_free(self) -> None:
        """Raise Conflict while requests are in flight (ERR_BATCH_BUSY)."""
        if self.busy:
            raise Conflict(f"batch {self.id} still has requests in flight")
