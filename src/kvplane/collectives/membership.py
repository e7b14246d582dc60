"""Membership agreement through the torch Store: views, decisions and epochs.

Every member posts a :class:`View` for the current epoch, waits (bounded) for the views of the
peers it can still reach, computes a proposal with the pure :func:`decide`, and the first proposal
written under ``decision/<epoch>`` by ``compare_set`` wins; everyone adopts that one. A replacement
process posts a join request and waits for a decision that admits its incarnation.

Key layout inside the group's PrefixStore (all values JSON)::

    kvp/addr/<rank>       {"port", "udp", "inc"}   a member's endpoints
    kvp/join/<rank>       {"port", "udp", "inc"}   a replacement waiting for a slot
    kvp/epoch             "<int>"                  newest decided epoch
    kvp/view/<e>/<rank>   View                     a member's view in epoch e
    kvp/decision/<e>      Decision                 membership of epoch e + 1

Owns no sockets and never imports the mesh.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from kvplane.common.errors import Timeout


@dataclass(frozen=True)
class Endpoint:
    """Where a rank's process listens.

    Attributes:
        port: TCP data-plane port on 127.0.0.1.
        udp: heartbeat UDP port on 127.0.0.1.
        inc: incarnation id of the process.
    """

    port: int
    udp: int
    inc: int


@dataclass(frozen=True)
class View:
    """One member's view of the group in an epoch.

    Attributes:
        reach: mask of ranks this member can still talk to (itself included).
        admit: ranks whose join requests this member saw, with their incarnations.
        drop: mask of ranks this member was asked to deactivate.
    """

    reach: int
    admit: dict[int, int] = field(default_factory=dict)
    drop: int = 0


@dataclass(frozen=True)
class Decision:
    """The agreed membership of the next epoch.

    Attributes:
        active: mask of active ranks.
        admitted: slots filled by replacements in this decision, with their incarnations.
    """

    active: int
    admitted: dict[int, int] = field(default_factory=dict)


def decide(views: dict[int, View]) -> Decision:
    """Combine the posted views into the next membership (pure).

    A member survives if it posted and every poster can reach it, and nobody asked to drop it.
    Join requests seen by any poster fill free slots.
    """
    active = 0
    for r in views:
        active |= 1 << r
    drop = 0
    admitted: dict[int, int] = {}
    for v in views.values():
        active &= v.reach
        drop |= v.drop
        admitted.update(v.admit)
    active &= ~drop
    admitted = {r: inc for r, inc in admitted.items() if not active >> r & 1 and not drop >> r & 1}
    for r in admitted:
        active |= 1 << r
    return Decision(active, dict(sorted(admitted.items())))


def _dump(obj: Any) -> str:
    return json.dumps(asdict(obj), sort_keys=True)


def _int_keys(d: dict[str, int]) -> dict[int, int]:
    return {int(k): int(v) for k, v in d.items()}


class Board:
    """Typed, deadline-bounded access to the membership keys of one group's Store.

    Args:
        store: the group's (prefix) store. Its calls block at most the timeouts passed here.
    """

    def __init__(self, store: dist.Store) -> None:
        self.store = store

    def _get(self, key: str, deadline: float) -> bytes:
        self.wait([key], deadline)
        return self.store.get(key)

    def wait(self, keys: list[str], deadline: float) -> None:
        """Block until every key exists.

        Raises:
            Timeout: when the deadline passes first.
        """
        left = deadline - time.monotonic()
        if left > 0 and self.store.check(keys):
            return
        if left <= 0:
            raise Timeout(f"store keys {keys} missing")
        try:
            self.store.wait(keys, timedelta(seconds=left))
        except (RuntimeError, dist.DistError) as exc:
            raise Timeout(f"store keys {keys} missing after {left:.2f}s") from exc

    def present(self, keys: list[str]) -> list[str]:
        """The subset of ``keys`` that exist now (non-blocking)."""
        return [k for k in keys if self.store.check([k])]

    def put_addr(self, rank: int, ep: Endpoint, joining: bool = False) -> None:
        """Publish a member's (or a joiner's) endpoints."""
        self.store.set(f"kvp/{'join' if joining else 'addr'}/{rank}", _dump(ep))

    def addr(self, rank: int, deadline: float, joining: bool = False) -> Endpoint:
        """Read a rank's endpoints, waiting for them."""
        raw = self._get(f"kvp/{'join' if joining else 'addr'}/{rank}", deadline)
        return Endpoint(**json.loads(raw))

    def clear_join(self, rank: int) -> None:
        """Remove ``rank``'s join request once it has been admitted."""
        self.store.delete_key(f"kvp/join/{rank}")

    def join_requests(self, slots: list[int]) -> dict[int, Endpoint]:
        """Join requests present now for ``slots`` (non-blocking)."""
        keys = self.present([f"kvp/join/{r}" for r in slots])
        return {int(k.rsplit("/", 1)[1]): Endpoint(**json.loads(self.store.get(k))) for k in keys}

    def epoch(self, deadline: float) -> int:
        """The newest decided epoch."""
        return int(self._get("kvp/epoch", deadline))

    def set_epoch(self, epoch: int) -> None:
        """Record ``epoch`` as decided (monotonic: never lowers the stored value)."""
        cur = self.store.compare_set("kvp/epoch", "", str(epoch)).decode()
        while int(cur) < epoch:
            cur = self.store.compare_set("kvp/epoch", cur, str(epoch)).decode()

    def post_view(self, epoch: int, rank: int, view: View) -> None:
        """Post this member's view for ``epoch``."""
        self.store.set(f"kvp/view/{epoch}/{rank}", _dump(view))

    def collect_views(self, epoch: int, ranks: list[int], deadline: float) -> dict[int, View]:
        """Views of ``ranks`` for ``epoch`` that arrive before the deadline."""
        keys = [f"kvp/view/{epoch}/{r}" for r in ranks]
        try:
            self.wait(keys, deadline)
            got = keys
        except Timeout:
            got = self.present(keys)
        out = {}
        for k in got:
            d = json.loads(self.store.get(k))
            out[int(k.rsplit("/", 1)[1])] = View(d["reach"], _int_keys(d["admit"]), d["drop"])
        return out

    def propose(self, epoch: int, decision: Decision) -> Decision:
        """Write ``decision`` for ``epoch`` unless one exists; return the one that won."""
        raw = self.store.compare_set(f"kvp/decision/{epoch}", "", _dump(decision))
        return self._parse_decision(raw)

    def decision(self, epoch: int, deadline: float) -> Decision:
        """Wait for and read the decision of ``epoch``."""
        return self._parse_decision(self._get(f"kvp/decision/{epoch}", deadline))

    @staticmethod
    def _parse_decision(raw: bytes) -> Decision:
        d = json.loads(raw)
        return Decision(d["active"], _int_keys(d["admitted"]))
