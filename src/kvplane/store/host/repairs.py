"""SegmentDuty: what a client that contributes a segment does for the master besides
heartbeating: fence acknowledgements and repairs.

* **Fences**: the heartbeat reply lists generations whose space the master wants to reuse.
  They are installed in this engine's listener (``kvplane.transfer.fence``), which refuses their
  frames from then on; the ones with no WRITE in progress are acknowledged at once, the others on
  a later heartbeat. Only acknowledged space is reused.
* **Repairs**: re-replication tasks (``RepairTask``): read the object from a surviving replica
  straight into this segment's memory, verify its checksum, write its inventory header in front
  of it (so the copy is re-registered like any replica after a failover), report with
  ``repair_done``. They
  run on one named daemon thread, off the heartbeat, each bounded by a deadline; the WRITE into
  our own memory is counted in the fence like a listener WRITE, so a fence of an abandoned
  repair is acknowledged only once its copy is over.

Built from the client's ``ClientContext``; imports the client's ``context`` and ``replica_io``
layers (never the facade).
"""

from __future__ import annotations

import logging
import queue
import threading

from kvplane.common.deadline import Deadline
from kvplane.common.errors import KVPlaneError
from kvplane.store.checksum import digest
from kvplane.store.client.context import ClientContext
from kvplane.store.client.replica_io import Move, ordered, run
from kvplane.store.types import RepairDoneReq, RepairTask
from kvplane.transfer import OpCode

log = logging.getLogger(__name__)
REPAIR_DEADLINE = 10.0  # seconds for one repair copy (the master abandons tasks at 30 s)


class SegmentDuty:
    """Fence acknowledgements and the repair worker of one client."""

    def __init__(self, ctx: ClientContext) -> None:
        self._c = ctx
        self._tasks: queue.Queue[list[RepairTask] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.repaired = 0

    def fence(self, gens: list[int]) -> list[int]:
        """Install ``gens``; returns those to acknowledge now."""
        return self._c.engine.fence.install(gens) if gens else []

    def submit(self, tasks: list[RepairTask]) -> None:
        """Queue repair tasks (starts the worker on first use)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, daemon=True,
                                            name=f"store-repair-{self._c.config.client_id[:8]}")
            self._thread.start()
        self._tasks.put(tasks)

    def _work(self) -> None:
        while True:
            tasks = self._tasks.get()
            if tasks is None or self._c.closed.is_set():
                return
            ok = [self._repair(t) for t in tasks]
            try:
                self._c.rpc.call("repair_done", RepairDoneReq(
                    self._c.config.client_id, [t.key for t in tasks], [t.gen for t in tasks], ok),
                    int, timeout=5.0)
            except KVPlaneError as exc:  # the master abandons the tasks at its deadline
                log.warning("reporting %d repairs failed: %s", len(tasks), exc)

    def _repair(self, task: RepairTask) -> bool:
        fence = self._c.engine.fence
        if not fence.begin_write(task.gen):
            return False
        try:
            deadline = Deadline.after(REPAIR_DEADLINE)
            for source in ordered(self._c, task.sources):
                move: Move = (0, source, OpCode.READ, task.addr, task.size)
                if run(self._c, [move], deadline)[0] and self._intact(task):
                    if task.header:
                        n = len(task.header)
                        self._c.engine.memory.view(task.addr - n, n)[:] = task.header
                    self.repaired += 1
                    return True
            return False
        finally:
            fence.end_write(task.gen)

    def _intact(self, task: RepairTask) -> bool:
        if not task.checksum:
            return True
        return digest(self._c.engine.memory.view(task.addr, task.size)) == task.checksum

    def close(self) -> None:
        """Stop the worker (it finishes the task at hand, bounded by its deadline)."""
        if self._thread is not None:
            self._tasks.put(None)
            self._thread.join(REPAIR_DEADLINE + 1)
