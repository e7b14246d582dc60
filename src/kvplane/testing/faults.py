"""FaultPlan: a seeded script of faults that in-memory transports, sockets and RPCs consult.

A plan is a list of rules. Each rule names a fault kind, the peer and the operation it applies
to (``None`` = any), how many matching operations pass untouched first (``after``), how many
times it fires (``times``, ``None`` = every later match) and, optionally, a probability
(``rate``) drawn from the plan's own ``random.Random(seed)``; the same seed and the same
sequence of operations inject the same faults. Rules are tried in the order they were added;
the first that fires wins. Every injected fault is counted in :attr:`FaultPlan.injected`, so a
test can assert on what was injected as well as on the outcome.

What each kind means is up to the component consulting the plan, along these lines:

* ``DROP``       the request is lost: the caller waits until its deadline and times out.
* ``DELAY``      the operation completes ``seconds`` late (a timeout if that is past the deadline).
* ``FAIL``       the peer answers with an error (``error``, default :class:`Unavailable`).
* ``CORRUPT``    one byte of the message is flipped (at ``at``, else a seeded position).
* ``DISCONNECT`` the connection breaks at this operation (``after=N``: after N good ones).

Consulted by :mod:`kvplane.testing.mem_transport`, :mod:`kvplane.testing.mem_rpc` and
:mod:`kvplane.testing.fake_data_socket`. Pure apart from one lock: must not import sockets,
clocks or any kvplane component beyond ``common``.

Example::

    plan = FaultPlan(seed=7).disconnect(peer="seg-a", after=3).fail(op="read", rate=0.1, times=None)
"""

from __future__ import annotations

import enum
import logging
import random
import threading
from collections import Counter
from dataclasses import dataclass, field

from kvplane.common.errors import KVPlaneError, Unavailable

log = logging.getLogger(__name__)


class FaultKind(enum.Enum):
    """What goes wrong with one operation."""

    DROP = "drop"
    DELAY = "delay"
    FAIL = "fail"
    CORRUPT = "corrupt"
    DISCONNECT = "disconnect"


@dataclass
class FaultRule:
    """One scripted fault (see the module docstring for the fields' meaning)."""

    kind: FaultKind
    peer: str | None = None
    op: str | None = None
    after: int = 0
    times: int | None = 1
    rate: float = 1.0
    seconds: float = 0.0
    at: int | None = None
    error: type[KVPlaneError] = Unavailable
    seen: int = 0
    fired: int = 0

    def matches(self, peer: str, op: str) -> bool:
        """True when this rule is about ``peer`` and ``op``."""
        return self.peer in (None, peer) and self.op in (None, op)

    def exhausted(self) -> bool:
        """True once the rule fired ``times`` times."""
        return self.times is not None and self.fired >= self.times


@dataclass(frozen=True)
class Fault:
    """A fault the plan decided to inject into one operation.

    Attributes:
        kind: what goes wrong.
        peer: the peer the operation was addressed to.
        op: the operation.
        seconds: the delay (``DELAY``).
        error: the error class the peer answers with (``FAIL``).
        position: a seeded byte position for ``CORRUPT`` (reduce it modulo the message length).
    """

    kind: FaultKind
    peer: str
    op: str
    seconds: float = 0.0
    error: type[KVPlaneError] = Unavailable
    position: int = 0

    def flip(self, data: bytearray | memoryview) -> None:
        """Corrupt ``data`` in place: invert the byte at ``position`` (mod its length)."""
        if len(data):
            i = self.position % len(data)
            data[i] ^= 0xFF


@dataclass
class FaultPlan:
    """A seeded, ordered list of :class:`FaultRule`; thread-safe.

    Args:
        seed: seeds the plan's random generator (rates and corrupt positions); logged.
    """

    seed: int = 0
    rules: list[FaultRule] = field(default_factory=list)
    injected: Counter[tuple[FaultKind, str, str]] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()
        log.info("fault plan seed %s", self.seed)

    # -- building ------------------------------------------------------------------------------
    def add(self, rule: FaultRule) -> FaultPlan:
        """Append ``rule``; returns the plan so calls chain."""
        with self._lock:
            self.rules.append(rule)
        return self

    def drop(self, peer: str | None = None, op: str | None = None, *, after: int = 0,
             times: int | None = 1, rate: float = 1.0) -> FaultPlan:
        """Lose matching requests (the caller times out)."""
        return self.add(FaultRule(FaultKind.DROP, peer, op, after, times, rate))

    def delay(self, seconds: float, peer: str | None = None, op: str | None = None, *,
              after: int = 0, times: int | None = 1, rate: float = 1.0) -> FaultPlan:
        """Complete matching operations ``seconds`` late."""
        return self.add(FaultRule(FaultKind.DELAY, peer, op, after, times, rate, seconds=seconds))

    def fail(self, peer: str | None = None, op: str | None = None, *, after: int = 0,
             times: int | None = 1, rate: float = 1.0,
             error: type[KVPlaneError] = Unavailable) -> FaultPlan:
        """Answer matching operations with ``error``."""
        return self.add(FaultRule(FaultKind.FAIL, peer, op, after, times, rate, error=error))

    def corrupt(self, peer: str | None = None, op: str | None = None, *, after: int = 0,
                times: int | None = 1, rate: float = 1.0, at: int | None = None) -> FaultPlan:
        """Flip one byte of matching messages (byte ``at``, else a seeded position)."""
        return self.add(FaultRule(FaultKind.CORRUPT, peer, op, after, times, rate, at=at))

    def disconnect(self, peer: str | None = None, op: str | None = None, *, after: int = 0,
                   times: int | None = 1, rate: float = 1.0) -> FaultPlan:
        """Break the connection at the first matching operation past ``after`` good ones."""
        return self.add(FaultRule(FaultKind.DISCONNECT, peer, op, after, times, rate))

    # -- consulting ----------------------------------------------------------------------------
    def decide(self, peer: str, op: str) -> Fault | None:
        """The fault to inject into one ``op`` addressed to ``peer``, or None (go ahead).

        Every live rule that matches counts the operation (so ``after`` counts all matching
        operations, faulted or not); the first one that is due fires.
        """
        with self._lock:
            chosen: FaultRule | None = None
            for rule in self.rules:
                if not rule.matches(peer, op) or rule.exhausted():
                    continue
                rule.seen += 1
                if chosen is None and rule.seen > rule.after and self._roll(rule.rate):
                    chosen = rule
            if chosen is None:
                return None
            chosen.fired += 1
            self.injected[(chosen.kind, peer, op)] += 1
            position = chosen.at if chosen.at is not None else self._rng.randrange(1 << 30)
            return Fault(chosen.kind, peer, op, chosen.seconds, chosen.error, position)

    def _roll(self, rate: float) -> bool:
        return rate >= 1.0 or self._rng.random() < rate

    def count(self, kind: FaultKind, peer: str | None = None, op: str | None = None) -> int:
        """How many faults of ``kind`` were injected (optionally for one peer and/or op)."""
        with self._lock:
            return sum(n for (k, p, o), n in self.injected.items()
                       if k is kind and peer in (None, p) and op in (None, o))
