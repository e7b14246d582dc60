"""One receiver's fetch of one version: parallel chunk reads, verification, reports.

The loop asks the tracker for fetches (``claim``), runs up to ``parallel`` of them at once on
worker threads (each one transfer-engine READ from the holder straight into the destination,
then a hash check of the landed bytes), and reports every outcome in its next claim: a good
chunk makes this node a holder at once; a corrupt, failed or timed-out one is retried from
another holder. Imports ``kvplane.common``, ``kvplane.transfer`` and ``kvplane.p2p``.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvplane.common.deadline import Deadline
from kvplane.common.errors import KVPlaneError, NotFound, Timeout
from kvplane.p2p import wire
from kvplane.p2p.client import TrackerClient
from kvplane.p2p.manifest import Manifest, digest
from kvplane.transfer import OpCode, TransferEngine, TransferRequest, TransferStatus

log = logging.getLogger(__name__)
IDLE_WAIT = 1.0  # long-poll when nothing is in flight


@dataclass
class FetchStats:
    """What one fetch did: sources used and failures seen, by reason."""

    seconds: float = 0.0
    sources: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class FetchPlan:
    """Everything a fetch needs besides the engine and the tracker."""

    manifest: Manifest
    reader: str
    addrs: list[int]  # where each chunk lands, in this engine's registered memory
    parallel: int = 4
    strategy: str = "rarest"
    chunk_timeout: float = 10.0


class Fetch:
    """Runs one fetch to completion or raises (a context for :meth:`run`).

    Args:
        engine: this node's transfer engine (destination memory registered in it).
        tracker: the tracker client.
        plan: the fetch.
        handle: ``handle(holder, timeout)`` returns an open segment handle (cached by the node);
            ``forget(holder)`` is called after a failure so the next use re-handshakes.
    """

    def __init__(self, engine: TransferEngine, tracker: TrackerClient, plan: FetchPlan,
                 handle: Callable[[str, float], int], forget: Callable[[str], None]) -> None:
        self.engine, self.tracker, self.plan = engine, tracker, plan
        self._handle, self._forget = handle, forget
        self._results: queue.Queue[tuple[int, str, str]] = queue.Queue()
        self.stats = FetchStats()

    def run(self, timeout: float) -> FetchStats:
        """Fetch every chunk within ``timeout`` seconds.

        Raises:
            Timeout: the deadline passed. NotFound: a chunk has no live holder left.
        """
        deadline = Deadline.after(timeout)
        t0 = time.monotonic()
        m, p = self.plan.manifest, self.plan
        n = len(m.chunks)
        inflight, left, first = 0, n, True
        done: list[tuple[int, str]] = []
        failed: list[tuple[int, str, str]] = []
        with cf.ThreadPoolExecutor(p.parallel, thread_name_prefix="p2p-fetch") as pool:
            while True:
                want = p.parallel - inflight if left > inflight else 0
                resp = self.tracker.claim(wire.ClaimReq(
                    m.name, m.version, p.reader, want=want, strategy=p.strategy,
                    wait=0.0 if inflight else min(IDLE_WAIT, deadline.remaining()),
                    addrs=p.addrs if first else None, done=done, failed=failed))
                first, done, failed, left = False, [], [], resp.left
                if left == 0:
                    break
                if resp.unavailable and not inflight and not resp.assign:
                    raise NotFound(f"{m.name} v{m.version}: chunks {resp.unavailable[:8]} "
                                   "have no live holder")
                for c, h, addr in resp.assign:
                    pool.submit(self._one, c, h, addr)
                inflight += len(resp.assign)
                deadline.check(f"p2p get of {m.name} v{m.version}")
                if inflight:
                    inflight -= self._collect(done, failed, deadline)
        self.stats.seconds = time.monotonic() - t0
        return self.stats

    def _collect(self, done: list[tuple[int, str]], failed: list[tuple[int, str, str]],
                 deadline: Deadline) -> int:
        """Wait for at least one finished fetch (then take every finished one)."""
        try:
            items = [self._results.get(timeout=max(deadline.remaining(), 1e-3))]
        except queue.Empty as exc:
            raise Timeout("p2p get timed out waiting for chunks") from exc
        while True:
            try:
                items.append(self._results.get_nowait())
            except queue.Empty:
                break
        for c, h, why in items:
            if why:
                failed.append((c, h, why))
                self.stats.failures[why] = self.stats.failures.get(why, 0) + 1
            else:
                done.append((c, h))
                self.stats.sources[h] = self.stats.sources.get(h, 0) + 1
        return len(items)

    def _one(self, c: int, holder: str, addr: int) -> None:
        why = "unreachable"
        try:
            why = self._fetch(c, holder, addr)
        except Exception:  # a bug must not strand the loop waiting for this result
            log.exception("fetching chunk %d from %s failed", c, holder)
        finally:
            self._results.put((c, holder, why))

    def _fetch(self, c: int, holder: str, addr: int) -> str:
        """One chunk: READ it into place and verify it; returns "" or a failure reason."""
        chunk = self.plan.manifest.chunks[c]
        local = self.plan.addrs[c]
        status = TransferStatus.FAILED
        for _attempt in range(2):  # a second try re-handshakes (the holder may have re-registered)
            try:
                h = self._handle(holder, min(2.0, self.plan.chunk_timeout))
                req = TransferRequest(OpCode.READ, local, h, addr, chunk.size)
                status = self.engine.transfer([req], timeout=self.plan.chunk_timeout)[0]
            except KVPlaneError as exc:
                log.debug("chunk %d from %s: %s", c, holder, exc)
                status = TransferStatus.FAILED
            if status == TransferStatus.COMPLETED:
                break
            self._forget(holder)
            if status == TransferStatus.TIMEOUT:
                return "timeout"
        if status != TransferStatus.COMPLETED:
            return "unreachable"
        view = self.engine.memory.view(local, chunk.size)
        if digest(view, self.plan.manifest.hash) != chunk.digest:
            log.warning("chunk %d of %s from %s failed its hash check: refetching",
                        c, self.plan.manifest.name, holder)
            return "corrupt"
        return ""
