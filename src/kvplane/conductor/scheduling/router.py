"""The live router: the same policies, fed by a running conductor and by engine progress reports.

``Router.route`` builds the :class:`ClusterView` from its own load bookkeeping (what it routed,
what the engines reported finished) and the conductor's prefix index (through
:class:`ConductorPrefixes`), then asks the policy. It owns no sockets: an HTTP front end or a proxy
calls ``route`` per request and the ``*_done`` hooks as engines report. Thread-safe (one lock).
Must not import the simulator.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from kvplane.common.errors import InvalidArgument, NotFound
from kvplane.conductor.scheduling.policy import SchedulingPolicy
from kvplane.conductor.scheduling.view import (ClusterView, Decision, DecodeLoad, PrefillLoad,
                                               PrefixSource, Request)


class Router:
    """Routes live requests with a :class:`SchedulingPolicy`.

    Args:
        policy: the policy (the same classes the simulator uses).
        prefixes: prefix source, normally :class:`~kvplane.conductor.scheduling.prefix.ConductorPrefixes`.
        prefill: prefill instance ids.
        decode: decode instance ids.
        kv_capacity: KV tokens per decode instance.
        max_batch: sequences per decode instance.
        clock: monotonic clock in seconds (injectable for tests).
    """

    def __init__(self, policy: SchedulingPolicy, prefixes: PrefixSource, prefill: Sequence[str],
                 decode: Sequence[str], kv_capacity: int, max_batch: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not prefill or not decode:
            raise InvalidArgument("the router needs at least one prefill and one decode instance")
        self.policy, self.prefixes, self.clock = policy, prefixes, clock
        self._prefill = {i: PrefillLoad(i) for i in prefill}
        self._decode = {i: DecodeLoad(i, kv_capacity=kv_capacity, max_batch=max_batch) for i in decode}
        self._busy: dict[str, float] = {i: 0.0 for i in prefill}  # predicted free time
        self._pending: dict[int, tuple[Decision, float, int]] = {}
        self._lock = threading.Lock()
        self.rejected = 0

    def route(self, request: Request) -> Decision:
        """Decide for one request and book its predicted load (non-blocking, no I/O but the index).

        Returns:
            The decision; a rejected one should be answered with HTTP 429.
        """
        with self._lock:
            now = self.clock()
            for i, p in self._prefill.items():
                p.queue_s = max(0.0, self._busy[i] - now)
            view = ClusterView(now, list(self._prefill.values()), list(self._decode.values()),
                               self.prefixes)
            d = self.policy.schedule(request, view)
            if d.rejected or d.prefill is None or d.decode is None:
                self.rejected += 1
                return d
            tm = self.policy.time_model
            blocks = d.prefix_blocks
            if not blocks and d.source is None:  # the policy did not look: ask the index once
                got = self.prefixes.match(request.hash_ids).get(d.prefill)
                blocks = got.longest if got is not None else 0
            tokens = tm.prefix_tokens(blocks, request.input_length)
            work = tm.prefill_s(request.input_length, tokens)
            queue = self._prefill[d.prefill].queue_s
            est = d.est_ttft_s if d.est_ttft_s is not None else queue + work
            self._busy[d.prefill] = max(now, self._busy[d.prefill]) + work
            p = self._prefill[d.prefill]
            p.queued += 1
            p.queued_tokens += request.input_length - tokens
            self._decode[d.decode].incoming[request.rid] = (now + est, request.input_length)
            self._pending[request.rid] = (d, work, request.input_length - tokens)
            return d

    def prefill_done(self, rid: int) -> None:
        """The prefill instance finished ``rid``; it now runs on its decode instance.

        Raises:
            NotFound: ``rid`` was not routed (or already reported).
        """
        with self._lock:
            got = self._pending.get(rid)
            if got is None:
                raise NotFound(f"request {rid} is not in prefill")
            d, work, tokens = got
            now = self.clock()
            p = self._prefill[d.prefill or ""]
            p.queued -= 1
            p.queued_tokens -= tokens
            if p.queued == 0:
                self._busy[d.prefill or ""] = now
            dec = self._decode[d.decode or ""]
            _, kv = dec.incoming.pop(rid, (0.0, 0))
            dec.starts[rid] = (now, kv)
            dec.running += 1
            dec.kv_tokens += kv

    def decode_done(self, rid: int) -> None:
        """The decode instance finished ``rid``.

        Raises:
            NotFound: ``rid`` is not decoding.
        """
        with self._lock:
            got = self._pending.pop(rid, None)
            dec = None if got is None else self._decode[got[0].decode or ""]
            if dec is None or rid not in dec.starts:
                raise NotFound(f"request {rid} is not decoding")
            _, kv = dec.starts.pop(rid)
            dec.running -= 1
            dec.kv_tokens -= kv

    def loads(self) -> tuple[list[PrefillLoad], list[DecodeLoad]]:
        """Copies of the current bookkeeping (for /instances-style views and tests)."""
        with self._lock:
            return ([PrefillLoad(p.instance, max(0.0, self._busy[p.instance] - self.clock()), p.queued,
                                 p.queued_tokens) for p in self._prefill.values()],
                    [DecodeLoad(d.instance, d.running, d.waiting, d.kv_tokens, d.kv_capacity,
                                d.max_batch, dict(d.starts), dict(d.incoming))
                     for d in self._decode.values()])
