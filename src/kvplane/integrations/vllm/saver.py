"""BackgroundSaver: asynchronous KV saves, so vLLM's forward pass never waits on the network.

One named daemon thread drains a bounded queue; a save that does not fit is dropped and counted
(a dropped save is a future miss, never an error in the inference loop). A batch may carry a
``prepare`` step run on the thread before the put (the device -> host copies of KV in device
memory: its failure fails the batch) and a ``done`` step run after it either way (giving staging
slots back). Imports no vLLM.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvplane.common.errors import KVPlaneError

log = logging.getLogger("vllm.kvplane.saver")
PutFn = Callable[[list[str], list[int], list[int]], Sequence[KVPlaneError | None]]
Hook = Callable[[], None]


@dataclass
class SaveStats:
    """Counters of one saver (objects, not requests)."""

    saved: int = 0
    failed: int = 0
    dropped: int = 0


@dataclass
class _Batch:
    req_id: str
    keys: list[str]
    addrs: list[int]
    sizes: list[int]
    prepare: Hook | None = None
    done: Hook | None = field(default=None, repr=False)


class BackgroundSaver:
    """Runs ``put(keys, addrs, sizes)`` batches off the caller's thread.

    Args:
        put: the store's ``batch_put_from``; returns per key None (stored) or an exception.
        queue_size: pending batches before new ones are dropped.
        name: thread name suffix.
    """

    def __init__(self, put: PutFn, queue_size: int, name: str = "kvplane-saver") -> None:
        self._put = put
        self._q: queue.Queue[_Batch | None] = queue.Queue(queue_size)
        self._pending: dict[str, int] = {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self.stats = SaveStats()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, req_id: str, keys: Sequence[str], addrs: Sequence[int],
               sizes: Sequence[int], prepare: Hook | None = None,
               done: Hook | None = None) -> bool:
        """Queue one batch; never blocks. False (and counted) when the queue is full.

        Args:
            prepare: run on the saver thread before the put; a ``KVPlaneError`` fails the batch.
            done: run after the batch (stored, failed or dropped).
        """
        with self._lock:
            self._pending[req_id] = self._pending.get(req_id, 0) + 1
        try:
            self._q.put_nowait(_Batch(req_id, list(keys), list(addrs), list(sizes), prepare, done))
            return True
        except queue.Full:
            if done is not None:
                done()
            self._finish(req_id, dropped=len(keys))
            log.warning("kvplane save queue full: dropped %d objects of %s", len(keys), req_id)
            return False

    def drop(self, req_id: str, count: int, why: str) -> None:
        """Count a batch of ``count`` objects that was never queued (``req_id`` is still known,
        so its finished request is reported like any other)."""
        with self._lock:
            self._pending[req_id] = self._pending.get(req_id, 0) + 1
        self._finish(req_id, dropped=count)
        log.warning("kvplane save of %s dropped %d objects: %s", req_id, count, why)

    def known(self, req_id: str) -> bool:
        """Whether ``req_id`` ever submitted a save that has not been forgotten."""
        with self._lock:
            return req_id in self._pending

    def pending(self, req_id: str) -> int:
        """Batches of ``req_id`` still queued or running."""
        with self._lock:
            return self._pending.get(req_id, 0)

    def forget(self, req_ids: Sequence[str] | set[str]) -> None:
        """Drop bookkeeping of finished requests."""
        with self._lock:
            for r in req_ids:
                if self._pending.get(r) == 0:
                    del self._pending[r]

    def drain(self, timeout: float) -> bool:
        """Block until nothing is pending (True) or ``timeout`` passes (False)."""
        with self._idle:
            return self._idle.wait_for(lambda: not any(self._pending.values()), timeout)

    def _finish(self, req_id: str, saved: int = 0, failed: int = 0, dropped: int = 0) -> None:
        with self._lock:
            self._pending[req_id] = self._pending.get(req_id, 1) - 1
            self.stats.saved += saved
            self.stats.failed += failed
            self.stats.dropped += dropped
            self._idle.notify_all()

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            keys = item.keys
            try:
                if item.prepare is not None:
                    item.prepare()
                results = self._put(keys, item.addrs, item.sizes)
                bad = sum(1 for r in results if r is not None)
            except KVPlaneError as exc:
                log.warning("kvplane save of %d objects failed: %s", len(keys), exc)
                bad = len(keys)
            finally:
                if item.done is not None:
                    item.done()
            if bad:
                log.warning("kvplane save: %d of %d objects not stored", bad, len(keys))
            self._finish(item.req_id, saved=len(keys) - bad, failed=bad)

    def close(self, timeout: float = 5.0) -> None:
        """Finish queued saves (up to ``timeout``), then stop the thread (idempotent)."""
        if not self._thread.is_alive():
            return
        self.drain(timeout)
        try:
            self._q.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)
