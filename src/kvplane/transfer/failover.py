"""Failover of a transport's failed slices to another transport (the engine's batches).

Split from ``kvplane.transfer.engine`` (its size budget); imports no sockets.
"""

from __future__ import annotations

import logging

from kvplane.common import metrics
from kvplane.common.deadline import Deadline
from kvplane.transfer.batch import Slice
from kvplane.transfer.seam import Route, Transport
from kvplane.transfer.types import TransferStatus

log = logging.getLogger("kvplane.transfer.engine")  # the engine's log, as before the split


class Shadow:
    """Stands in for a slice and captures its outcome (``status``, ``error``) instead of
    reporting it: a failure can be retried elsewhere first, and a staged device request
    (``kvplane.transfer.staged``) reports once for all its chunks."""

    __slots__ = ("orig", "op", "local", "remote", "length", "status", "error", "task", "addr",
                 "device")

    def __init__(self, s: Slice) -> None:
        self.orig, self.op, self.local, self.remote, self.length = s, s.op, s.local, s.remote, s.length
        self.addr, self.device = s.addr, s.device  # a DeviceSlice's device side
        self.task = s.task
        self.status: TransferStatus | None = None
        self.error = ""

    def done(self, status: TransferStatus, error: str = "") -> None:
        self.status, self.error = status, error


def guarded(t: Transport, route: Route, slices: list[Slice], deadline: Deadline,
             fallback: Transport | None = None) -> None:
    """Run a transport, failing over to ``fallback`` for slices it FAILED (not timed out).

    A bug in a transport fails its unfinished requests instead of leaving them PENDING forever.
    """
    if fallback is not None:
        shadows = [Shadow(s) for s in slices]
        guarded(t, route, shadows, deadline)  # type: ignore[arg-type]  # a Shadow stands in for its Slice
        retry = [sh.orig for sh in shadows if sh.status == TransferStatus.FAILED and not deadline.expired()]
        for sh in shadows:
            if sh.status != TransferStatus.FAILED or deadline.expired():
                sh.orig.done(sh.status or TransferStatus.FAILED, sh.error)
        if retry:
            metrics.TRANSFER_FAILOVERS.labels(t.name).inc(len(retry))
            log.info("%d slice(s) failed on %s; failing over to %s", len(retry), t.name,
                     fallback.name)
            guarded(fallback, route, retry, deadline)
        return
    try:
        t.run(route, slices, deadline)
    except Exception as exc:
        log.exception("transport %s failed", t.name)
        for s in slices:
            if isinstance(s, Shadow):
                if s.status is None:
                    s.done(TransferStatus.FAILED, f"internal error in {t.name}: {exc}")
            elif not s.task.status.done:
                s.task.batch.fail(s.task, TransferStatus.FAILED, f"internal error in {t.name}: {exc}")
