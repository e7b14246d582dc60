"""Holdings: what a client that contributes a segment does when it (re)mounts, and with forgets.

* **Remount** (a new leader, a restarted master, a remount after the TTL): the master's reply
  names its epoch and the fence floor. The segment's listener (and its shared-memory word)
  admit only that epoch from the floor up, in-flight WRITEs of older generations are waited
  for, then the segment scans its own memory for the records the objects carry
  (``kvplane.store.inventory``) and re-registers every intact one (``adopt``, in batches). The
  master answers each with a generation of its epoch (written back into the header) or 0 (the
  header is invalidated). In HA a mount answer from a leader older than one already seen is
  refused: a deposed leader never takes a segment back.
* **Forgets**: the heartbeat reply lists allocations the master freed; their headers are
  cleared (if they still carry that generation) and acknowledged, so removed objects do not
  come back after the next failover.

The epochs this segment mounted with are kept in order (``history``): they order the records
of past masters, whose epochs are random numbers for a lone master. Built from the client's
``ClientContext``; imports the client's ``context`` layer only (never the facade).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from kvplane.common import log as klog
from kvplane.common.deadline import Deadline
from kvplane.store import inventory
from kvplane.store.client.context import ClientContext
from kvplane.store.errors import NotLeader
from kvplane.store.types import AdoptReq, MountRep

log = logging.getLogger(__name__)
HISTORY = 64  # epochs remembered
BATCH = 2048  # records per adopt call
DRAIN = 10.0  # seconds to wait for in-flight WRITEs of an older mount


class Holdings:
    """The records of one client's segment, and their re-registration."""

    def __init__(self, ctx: ClientContext) -> None:
        self._c = ctx
        self.history: list[int] = []
        self.secret = b""  # the master's tag key, from its mount answer
        self.adopted = 0
        self.refused = 0
        self.last_scan_s = 0.0

    def memory(self) -> np.ndarray:
        """The bytes of the contributed segment."""
        seg = self._c.segments[0]
        return np.frombuffer(self._c.engine.memory.view(seg.base, seg.size), np.uint8)

    def mounted(self, rep: MountRep) -> None:
        """Apply a mount answer; re-register what the segment holds unless it is fresh."""
        c = self._c
        if c.rpc.ha and rep.epoch < c.rpc.term:
            raise NotLeader(f"a master of term {rep.epoch} answered after term {c.rpc.term}")
        c.rpc.saw_epoch(rep.epoch)
        self.secret = rep.secret  # the master's tag key: a segment's own token may differ
        fresh = not self.history
        c.engine.fence.set_epoch(rep.epoch, rep.floor)
        if not self.history or self.history[-1] != rep.epoch:
            self.history = (self.history + [rep.epoch])[-HISTORY:]
        if not fresh:
            self._drain()
            self._adopt()

    def _drain(self) -> None:
        deadline = Deadline.after(DRAIN)
        fence = self._c.engine.fence
        while fence.writing_outside() and not deadline.expired():
            time.sleep(0.005)  # a WRITE admitted before the remount is still landing

    def _adopt(self) -> None:
        seg = self._c.segments[0]
        self.register(self.memory(), seg.name, self.history,
                      lambda req: self._c.rpc.call("adopt", req, list[int]))

    def register(self, mem: np.ndarray, name: str, history: list[int],
                 adopt: Callable[[AdoptReq], list[int]],
                 keep: Callable[[inventory.Record], bool] | None = None) -> None:
        """Scan ``mem`` (segment ``name``'s memory, or the share of it one master allocates
        in: record offsets count from its start) and re-register its records in batches
        through ``adopt``; a record ``keep`` refuses is cleared without being sent."""
        t0 = time.monotonic()
        found = inventory.scan(mem, self.secret, history)
        for off in found.stale:
            inventory.invalidate(mem, off)
        self.last_scan_s = time.monotonic() - t0
        recs = found.records
        if keep is not None:
            for rec in recs:
                if not keep(rec):
                    inventory.invalidate(mem, rec.offset)
            recs = [r for r in recs if keep(r)]
        for start in range(0, max(1, len(recs)), BATCH):
            batch = recs[start:start + BATCH]
            gens = adopt(AdoptReq(self._c.config.client_id, name, batch, history,
                                  done=start + BATCH >= len(recs)))
            for rec, gen in zip(batch, gens):
                if gen:
                    inventory.restamp(mem, rec.offset, gen)
                else:
                    inventory.invalidate(mem, rec.offset)
            self.adopted += sum(1 for g in gens if g)
            self.refused += sum(1 for g in gens if not g)
        klog.event("store_segment_adopted", segment=name, records=len(recs),
                   adopted=self.adopted, scan_s=round(self.last_scan_s, 3))

    def forget(self, forgets: list[tuple[int, int]]) -> list[int]:
        """Clear the headers the master freed; returns their generations to acknowledge."""
        if not forgets or not self._c.segments:
            return []
        mem = self.memory()
        base = self._c.segments[0].base
        for gen, addr in forgets:
            inventory.invalidate(mem, addr - base, gen)
        return [g for g, _ in forgets]
