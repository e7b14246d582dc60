"""The live router: the same policies, fed by a running conductor and by engine progress reports.

``Router.route`` builds the :class:`ClusterView` from its own load bookkeeping (what it routed,
what the engines reported finished, what their ``/metrics`` say) and the conductor's prefix index
(through :class:`ConductorPrefixes`), then asks the policy. It owns no sockets: an HTTP front end
or a proxy (``kvplane.conductor.gateway``) calls ``route`` per request and the ``*_done`` hooks as
engines report. Instances can be taken out (``set_available``) and put back; a failed request is
``abandon``-ed so its booked load goes away. In ``colocated`` mode every instance serves both
phases: the policy's prefill pick is also where the request decodes. Thread-safe (one lock).
Must not import the simulator.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

from kvplane.common.errors import InvalidArgument, NotFound, Unavailable
from kvplane.conductor.scheduling.policy import SchedulingPolicy
from kvplane.conductor.scheduling.view import (
    ClusterView,
    Decision,
    DecodeLoad,
    PrefillLoad,
    PrefixSource,
    Request,
)

_EWMA = 0.2  # weight of the newest prefill estimate in the mean work of one request
_SLOW_RANGE = (0.25, 20.0)  # bounds of the measured / predicted first-token time ratio
_OVERDUE = 0.5  # a prefill in flight has at least this share of its booked work left


@dataclass(slots=True)
class _Booked:
    """A routed request in flight: its decision and what was booked for it."""

    decision: Decision
    work: float  # prefill seconds booked on its prefill instance (at the measured pace)
    tokens: int  # prompt tokens it computes there (not reused)
    at: float  # when it was routed
    est: float  # the TTFT predicted for it (the measured pace's reference)


class Router:
    """Routes live requests with a :class:`SchedulingPolicy`.

    Args:
        policy: the policy (the same classes the simulator uses).
        prefixes: prefix source, normally :class:`~kvplane.conductor.scheduling.prefix.ConductorPrefixes`.
        prefill: prefill instance ids.
        decode: decode instance ids (in ``colocated`` mode, the same ids as ``prefill``).
        kv_capacity: KV tokens per decode instance.
        max_batch: sequences per decode instance.
        clock: monotonic clock in seconds (injectable for tests).
        colocated: every instance prefills and decodes its own requests.
    """

    def __init__(self, policy: SchedulingPolicy, prefixes: PrefixSource, prefill: Sequence[str],
                 decode: Sequence[str], kv_capacity: int, max_batch: int,
                 clock: Callable[[], float] = time.monotonic, colocated: bool = False) -> None:
        if bool(prefill) != bool(decode):  # none of either is fine: instances may come later
            raise InvalidArgument("the router needs at least one prefill and one decode instance")
        if colocated and list(prefill) != list(decode):
            raise InvalidArgument("colocated mode needs the same instances for prefill and decode")
        self.policy, self.prefixes, self.clock = policy, prefixes, clock
        self.colocated = colocated
        self._kv_capacity, self._max_batch = kv_capacity, max_batch
        self._prefill = {i: PrefillLoad(i) for i in prefill}
        self._decode = {i: DecodeLoad(i, kv_capacity=kv_capacity, max_batch=max_batch) for i in decode}
        self._busy: dict[str, float] = {i: 0.0 for i in prefill}  # predicted free time
        self._held: dict[str, float] = {i: 0.0 for i in prefill}  # booked work in prefill there
        self._down: set[str] = set()
        self._foreign: dict[str, int] = {i: 0 for i in prefill}  # engine-reported, not ours
        self._pending: dict[int, _Booked] = {}
        self._work_s = 0.0  # running mean of one routed prefill's predicted seconds
        self._slow = 1.0  # running mean of measured / predicted time to the first token
        self._lock = threading.Lock()
        self.rejected = 0

    # availability and engine reports ---------------------------------------------------------
    def set_available(self, instance: str, up: bool) -> None:
        """Take an instance out of (``up=False``) or back into the views policies see.

        Raises:
            NotFound: unknown instance.
        """
        with self._lock:
            if instance not in self._prefill and instance not in self._decode:
                raise NotFound(f"unknown instance {instance!r}")
            (self._down.discard if up else self._down.add)(instance)

    def add_instance(self, instance: str, prefill: bool, decode: bool) -> None:
        """Add an instance (discovered at run time); it starts available. Idempotent.

        Raises:
            InvalidArgument: neither role, or a colocated instance without both.
        """
        if not (prefill or decode) or (self.colocated and not (prefill and decode)):
            raise InvalidArgument(f"instance {instance!r}: bad roles for this router")
        with self._lock:
            if prefill and instance not in self._prefill:
                self._prefill[instance] = PrefillLoad(instance)
                self._busy[instance], self._held[instance] = 0.0, 0.0
                self._foreign[instance] = 0
            if decode and instance not in self._decode:
                self._decode[instance] = DecodeLoad(instance, kv_capacity=self._kv_capacity,
                                                    max_batch=self._max_batch)

    def available(self) -> tuple[list[str], list[str]]:
        """The prefill and decode instances currently offered to the policy."""
        with self._lock:
            return ([i for i in self._prefill if i not in self._down],
                    [i for i in self._decode if i not in self._down])

    def observe(self, instance: str, waiting: int, kv_capacity: int | None = None) -> None:
        """Record what an engine reports (its ``/metrics``): requests waiting for a first step.

        Waiting requests beyond the ones this router has in prefill there were sent by someone
        else; each adds the mean predicted prefill time of this router's requests to the
        instance's queue estimate.

        Args:
            instance: instance id (unknown ids are ignored).
            waiting: the engine's ``num_requests_waiting``.
            kv_capacity: the engine's KV capacity in tokens, when known (decode load).
        """
        with self._lock:
            p = self._prefill.get(instance)
            if p is not None:
                self._foreign[instance] = max(0, waiting - p.queued)
            d = self._decode.get(instance)
            if d is not None and kv_capacity:
                d.kv_capacity = kv_capacity

    # routing -----------------------------------------------------------------------------------
    def _view(self, now: float, exclude: Collection[str]) -> ClusterView:
        for i, p in self._prefill.items():
            p.queue_s = self._queue_s(i, p.queued, now)
        skip = self._down | set(exclude)
        prefill = [p for i, p in self._prefill.items() if i not in skip]
        decode = [d for i, d in self._decode.items() if i not in skip]
        if not prefill or not decode:
            raise Unavailable("no prefill or decode instance is available")
        return ClusterView(now, prefill, decode, self.prefixes)

    def _queue_s(self, instance: str, queued: int, now: float) -> float:
        """Predicted seconds before ``instance`` starts a new prefill.

        Our prefills there end at ``_busy`` (booked at the measured pace, ``slowdown``). One
        that has not reported its first token by then is still running: the instance is never
        predicted idle while one of ours is in prefill there (``_OVERDUE`` of the mean booked
        work of those prefills is left, however long past their predicted end).
        """
        left = self._busy[instance] - now
        if queued > 0:
            left = max(left, _OVERDUE * self._held[instance] / queued)
        return max(0.0, left) + self._foreign[instance] * self._work_s

    @property
    def slowdown(self) -> float:
        """Measured / predicted time to the first token, a running mean over prefills done.

        The time model is a fit made once (``ModelConfig.prefill_fit``) or a FLOP count; the
        engines run slower when their host is loaded. Booked work is scaled by this ratio, so
        the queue a policy sees is the one the engines show.
        """
        with self._lock:
            return self._slow

    def decide(self, request: Request, exclude: Collection[str] = ()) -> Decision:
        """The policy's decision without booking any load (``POST /route`` answers with it).

        Raises:
            Unavailable: every instance is down or excluded.
        """
        with self._lock:
            d = self.policy.schedule(request, self._view(self.clock(), exclude))
            return self._colocate(d)

    def _colocate(self, d: Decision) -> Decision:
        if self.colocated and not d.rejected and d.prefill is not None:
            return replace(d, decode=d.prefill)
        return d

    def route(self, request: Request, exclude: Collection[str] = ()) -> Decision:
        """Decide for one request and book its predicted load (non-blocking, no I/O but the index).

        Args:
            request: the request; ``rid`` must be unique among requests in flight.
            exclude: instances not to use (a retry excludes the one that failed).

        Returns:
            The decision; a rejected one should be answered with HTTP 429.

        Raises:
            Unavailable: every instance is down or excluded.
            InvalidArgument: ``rid`` is already in flight.
        """
        with self._lock:
            if request.rid in self._pending:
                raise InvalidArgument(f"request {request.rid} is already routed")
            now = self.clock()
            d = self._colocate(self.policy.schedule(request, self._view(now, exclude)))
            if d.rejected or d.prefill is None or d.decode is None:
                self.rejected += 1
                return d
            self._book(request, d, now)
            return d

    def _book(self, request: Request, d: Decision, now: float) -> None:
        tm = self.policy.time_model
        blocks = d.prefix_blocks
        if not blocks and d.source is None:  # the policy did not look: ask the index once
            got = self.prefixes.match(request.hash_ids).get(d.prefill or "")
            blocks = got.longest if got is not None else 0
        tokens = tm.prefix_tokens(blocks, request.input_length)
        predicted = tm.prefill_s(request.input_length, tokens)
        work = predicted * self._slow
        self._work_s = work if not self._work_s else (1 - _EWMA) * self._work_s + _EWMA * work
        p = self._prefill[d.prefill or ""]
        est = d.est_ttft_s if d.est_ttft_s is not None else p.queue_s + predicted
        self._busy[p.instance] = max(now, self._busy[p.instance]) + work
        self._held[p.instance] += work
        p.queued += 1
        p.queued_tokens += request.input_length - tokens
        self._decode[d.decode or ""].incoming[request.rid] = (now + est, request.input_length)
        self._pending[request.rid] = _Booked(d, work, request.input_length - tokens, now, est)

    # progress reports --------------------------------------------------------------------------
    def prefill_done(self, rid: int) -> None:
        """The prefill instance finished ``rid``; it now runs on its decode instance.

        Raises:
            NotFound: ``rid`` was not routed (or already reported).
        """
        with self._lock:
            got = self._pending.get(rid)
            dec = None if got is None else self._decode[got.decision.decode or ""]
            if got is None or dec is None or rid not in dec.incoming:
                raise NotFound(f"request {rid} is not in prefill")
            now = self.clock()
            self._unqueue(got, now)
            self._measured(got, now)
            _, kv = dec.incoming.pop(rid)
            dec.starts[rid] = (now, kv)
            dec.running += 1
            dec.kv_tokens += kv

    def _measured(self, got: _Booked, now: float) -> None:
        """Fold ``got``'s measured time to its first token into ``slowdown``."""
        if got.est > 0 and now > got.at:
            lo, hi = _SLOW_RANGE
            ratio = min(hi, max(lo, (now - got.at) / got.est))
            self._slow = (1 - _EWMA) * self._slow + _EWMA * ratio

    def _unqueue(self, got: _Booked, now: float) -> None:
        p = self._prefill[got.decision.prefill or ""]
        p.queued -= 1
        p.queued_tokens -= got.tokens
        self._held[p.instance] -= got.work
        if p.queued == 0:
            self._busy[p.instance], self._held[p.instance] = now, 0.0

    def decode_done(self, rid: int) -> None:
        """The decode instance finished ``rid``.

        Raises:
            NotFound: ``rid`` is not decoding.
        """
        with self._lock:
            got = self._pending.get(rid)
            dec = None if got is None else self._decode[got.decision.decode or ""]
            if dec is None or rid not in dec.starts:
                raise NotFound(f"request {rid} is not decoding")
            del self._pending[rid]
            _, kv = dec.starts.pop(rid)
            dec.running -= 1
            dec.kv_tokens -= kv

    def abandon(self, rid: int) -> bool:
        """Forget ``rid`` wherever it is (it failed, or its client went away); idempotent.

        Returns:
            True if ``rid`` was in flight.
        """
        with self._lock:
            got = self._pending.pop(rid, None)
            if got is None:
                return False
            dec = self._decode[got.decision.decode or ""]
            if rid in dec.incoming:
                self._unqueue(got, self.clock())
                dec.incoming.pop(rid)
            elif rid in dec.starts:
                _, kv = dec.starts.pop(rid)
                dec.running -= 1
                dec.kv_tokens -= kv
            return True

    def in_flight(self) -> int:
        """Requests routed and not yet done or abandoned."""
        with self._lock:
            return len(self._pending)

    def loads(self) -> tuple[list[PrefillLoad], list[DecodeLoad]]:
        """Copies of the current bookkeeping (for /instances-style views and tests)."""
        with self._lock:
            now = self.clock()
            return ([PrefillLoad(p.instance, self._queue_s(p.instance, p.queued, now), p.queued,
                                 p.queued_tokens) for p in self._prefill.values()],
                    [DecodeLoad(d.instance, d.running, d.waiting, d.kv_tokens, d.kv_capacity,
                                d.max_batch, dict(d.starts), dict(d.incoming))
                     for d in self._decode.values()])
