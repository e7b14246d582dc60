"""Trace-driven discrete-event simulation of a prefill/decode cluster under one policy.

Model (constants in ``config.py``): X prefill instances, each a FIFO running one prefill at a time;
its duration is the time to bring reused blocks to the GPU plus the prefill time of the rest,
computed from the caches *when the prefill starts*. When it ends the first token is out (TTFT), the
request's blocks enter the instance's LRU tiers and the pool, and the request moves to its decode
instance (KV streaming is layer-wise and overlapped, so it adds no time). Y decode instances run
continuous batching in continuous time: the step time (``TimeModel.decode_step_s``) is recomputed
whenever a sequence joins or leaves; a sequence waits when its KV (prompt + output, reserved on
admission) does not fit. The policy sees the cluster through the same :class:`ClusterView` the live
router builds, and prefix matches come from the conductor's :class:`PrefixIndex`, fed with the
caches' stores and evictions. No wall clock is read; all randomness is in the seeded policy.
"""

from __future__ import annotations

import heapq
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvplane.conductor.indexer import PrefixIndex
from kvplane.conductor.scheduling.cache import InstanceCache, PoolCache, walk
from kvplane.conductor.scheduling.config import SimConfig
from kvplane.conductor.scheduling.outcomes import Outcome, tbt
from kvplane.conductor.scheduling.policy import SchedulingPolicy, create_policy
from kvplane.conductor.scheduling.prefix import POOL, IndexPrefixes
from kvplane.conductor.scheduling.timemodel import TimeModel
from kvplane.conductor.scheduling.view import ClusterView, Decision, DecodeLoad, PrefillLoad, Request

log = logging.getLogger(__name__)
_PREFILL_DONE, _DECODE_TICK = 0, 1
_EPS = 1e-9


@dataclass(slots=True)
class _Job:
    req: Request
    decision: Decision
    est_s: float
    est_tokens: int
    outcome: Outcome


@dataclass(slots=True)
class _Run:
    rid: int
    outcome: Outcome
    remaining: float
    kv: float
    reserve: int
    wait: float
    gaps: list[tuple[float, float]] = field(default_factory=list)


class _Prefill:
    __slots__ = ("idx", "load", "cache", "queue", "running", "busy_until", "queued_est")

    def __init__(self, idx: int, load: PrefillLoad, cache: InstanceCache) -> None:
        self.idx, self.load, self.cache = idx, load, cache
        self.queue: deque[_Job] = deque()
        self.running: _Job | None = None
        self.busy_until = 0.0
        self.queued_est = 0.0


class _Decode:
    __slots__ = ("load", "active", "waiting", "step", "last", "version", "reserved")

    def __init__(self, load: DecodeLoad) -> None:
        self.load = load
        self.active: dict[int, _Run] = {}
        self.waiting: deque[_Run] = deque()
        self.step = 0.0
        self.last = 0.0
        self.version = 0
        self.reserved = 0


@dataclass
class SimResult:
    """Outcomes of one run plus counters.

    Attributes:
        policy: policy name.
        outcomes: one per request, in trace order.
        index_calls: prefix-index matches issued.
        transfers: prefills that pulled a prefix from another instance.
        end_s: simulated time of the last event.
    """

    policy: str
    outcomes: list[Outcome]
    index_calls: int = 0
    transfers: int = 0
    end_s: float = 0.0


class Simulator:
    """Replays requests through a cluster under one policy.

    Args:
        config: the simulation configuration.
        policy: a policy instance, or a registry name (built with ``config.policy`` and ``config.seed``).
        index: the prefix index to feed and query (None = a fresh one).
    """

    def __init__(self, config: SimConfig, policy: SchedulingPolicy | str,
                 index: PrefixIndex | None = None) -> None:
        self.config = config
        self.tm = TimeModel(config.model, config.cluster)
        self.policy = (create_policy(policy, config.policy, self.tm, config.seed)
                       if isinstance(policy, str) else policy)
        self.policy_name = policy if isinstance(policy, str) else self.policy.name
        cl = config.cluster
        names = [f"p{i}" for i in range(cl.prefill_instances)]
        self.prefixes = IndexPrefixes(index if index is not None else PrefixIndex(), names,
                                      pool=cl.pool_blocks > 0)
        self.pool = PoolCache(cl.pool_blocks, self.prefixes, POOL) if cl.pool_blocks > 0 else None
        self.prefill = [_Prefill(i, PrefillLoad(n, gpu_capacity_blocks=max(1, cl.gpu_cache_blocks)),
                                 InstanceCache(n, cl.gpu_cache_blocks, cl.cpu_cache_blocks, self.prefixes))
                        for i, n in enumerate(names)]
        cap, mb = config.model.decode_kv_capacity_tokens, config.model.decode_max_batch
        self.decode = [_Decode(DecodeLoad(f"d{i}", kv_capacity=cap, max_batch=mb))
                       for i in range(cl.decode_instances)]
        self._p = {p.load.instance: p for p in self.prefill}
        self._d = {d.load.instance: i for i, d in enumerate(self.decode)}
        self._events: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self._transfers = 0
        self.view = ClusterView(0.0, [p.load for p in self.prefill], [d.load for d in self.decode],
                                self.prefixes)

    # driver -------------------------------------------------------------------------------------
    def run(self, requests: Sequence[Request],
            progress: Callable[[int, int], None] | None = None) -> SimResult:
        """Replay ``requests`` (sorted by arrival) to completion.

        Args:
            requests: the trace.
            progress: called as ``progress(done, total)`` every 256 arrivals and at the end.

        Returns:
            The outcomes, in the order of ``requests``.
        """
        log.info("simulate policy=%s seed=%d requests=%d load=%.3g", self.policy_name,
                 self.config.seed, len(requests), self.config.cluster.load)
        outcomes = []
        now = 0.0
        for i, req in enumerate(requests):
            now = self._drain(req.arrival_s)
            outcomes.append(self._arrive(req))
            if progress is not None and i % 256 == 255:
                progress(i + 1, len(requests))
        now = self._drain(float("inf"))
        if progress is not None:
            progress(len(requests), len(requests))
        return SimResult(self.policy_name, outcomes, self.prefixes.calls, self._transfers, now)

    def _push(self, t: float, kind: int, idx: int, tag: int) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, kind, self._seq, idx, tag))

    def _drain(self, until: float) -> float:
        ev, last = self._events, self.view.now
        while ev and ev[0][0] <= until:
            t, kind, _, idx, tag = heapq.heappop(ev)
            last = t
            if kind == _PREFILL_DONE:
                self._prefill_done(self.prefill[idx], t)
            elif tag == self.decode[idx].version:
                self._decode_tick(self.decode[idx], t)
        self.view.now = until if until != float("inf") else last
        return self.view.now

    # prefill ------------------------------------------------------------------------------------
    def _arrive(self, req: Request) -> Outcome:
        now = self.view.now
        for p in self.prefill:
            p.load.queue_s = max(0.0, p.busy_until - now) + p.queued_est
        decision = self.policy.schedule(req, self.view)
        out = Outcome(req.rid, req.arrival_s, len(req.hash_ids))
        if decision.rejected or decision.prefill is None or decision.decode is None:
            out.rejected = decision.reject or "unrouted"
            return out
        out.prefill, out.decode = decision.prefill, decision.decode
        p = self._p[decision.prefill]
        est_s, est_tokens = self._estimate(req, decision)
        job = _Job(req, decision, est_s, est_tokens, out)
        p.queue.append(job)
        p.queued_est += est_s
        p.load.queued += 1
        p.load.queued_tokens += est_tokens
        d = self.decode[self._d[decision.decode]].load
        d.incoming[req.rid] = (now + p.load.queue_s + est_s, req.input_length)
        if p.running is None:
            self._start(p, now)
        return out

    def _estimate(self, req: Request, decision: Decision) -> tuple[float, int]:
        """The system's own prediction of a queued prefill (same model for every policy)."""
        tm = self.tm
        m = self.prefixes.match_one(decision.prefill or "", req.hash_ids)
        if decision.source is not None and decision.prefix_blocks > m.longest:
            move = tm.reuse_s(cpu_blocks=m.cpu - m.gpu, remote_blocks=decision.prefix_blocks - m.cpu)
            prefix = decision.prefix_blocks
        else:
            move = tm.reuse_s(cpu_blocks=m.cpu - m.gpu, pool_blocks=m.longest - m.cpu)
            prefix = m.longest
        tokens = tm.prefix_tokens(prefix, req.input_length)
        return move + tm.prefill_s(req.input_length, tokens), req.input_length - tokens

    def _start(self, p: _Prefill, now: float) -> None:
        job = p.queue.popleft()
        p.queued_est -= job.est_s
        if not p.queue:
            p.queued_est = 0.0  # no float drift when the queue empties
        req, tm = job.req, self.tm
        src = self._p[job.decision.source].cache if job.decision.source else None
        g, c, r, q = walk(req.hash_ids, p.cache, src, self.pool)
        if r > c:
            self._transfers += 1
        job.outcome.hits = (g, c - g, r - c, q - r)
        move = tm.reuse_s(cpu_blocks=c - g, remote_blocks=r - c, pool_blocks=q - r)
        dur = move + tm.prefill_s(req.input_length, tm.prefix_tokens(q, req.input_length))
        p.running = job
        p.busy_until = now + dur
        self._push(now + dur, _PREFILL_DONE, p.idx, 0)

    def _prefill_done(self, p: _Prefill, now: float) -> None:
        job = p.running
        if job is None:
            return
        p.running = None
        req, out = job.req, job.outcome
        out.ttft_s = now - req.arrival_s
        p.cache.put(req.hash_ids)
        if self.pool is not None:
            self.pool.put(req.hash_ids)
        p.load.queued -= 1
        p.load.queued_tokens -= job.est_tokens
        p.load.cached_blocks = len(p.cache.gpu)
        di = self._d[job.decision.decode or ""]
        self.decode[di].load.incoming.pop(req.rid, None)
        if req.output_length <= 1:
            out.tbt_s, out.finish_s = 0.0, now
        else:
            run = _Run(req.rid, out, float(req.output_length - 1), float(req.input_length),
                       req.input_length + req.output_length, now)
            self._decode_join(di, run, now)
        if p.queue:
            self._start(p, now)

    # decode -------------------------------------------------------------------------------------
    def _advance(self, d: _Decode, now: float) -> list[_Run]:
        """Run the batch from ``d.last`` to ``now``; return sequences that finished."""
        dt, done = now - d.last, []
        if d.active and d.step > 0 and dt > 0:
            steps = dt / d.step
            grown = 0.0
            for run in d.active.values():
                take = steps if steps < run.remaining else run.remaining
                run.gaps.append((d.step, take))
                run.remaining -= take
                run.kv += take
                grown += take
                if run.remaining <= _EPS:
                    done.append(run)
            d.load.kv_tokens += grown
        d.last = now
        return done

    def _decode_join(self, di: int, run: _Run, now: float) -> None:
        d = self.decode[di]
        done = self._advance(d, now)
        d.waiting.append(run)
        d.load.waiting += 1
        self._settle(di, d, done, now)

    def _decode_tick(self, d: _Decode, now: float) -> None:
        self._settle(self._d[d.load.instance], d, self._advance(d, now), now)

    def _settle(self, di: int, d: _Decode, done: list[_Run], now: float) -> None:
        load = d.load
        for run in done:
            del d.active[run.rid]
            load.starts.pop(run.rid, None)
            d.reserved -= run.reserve
            load.kv_tokens -= run.kv
            run.outcome.finish_s = now
            run.outcome.tbt_s = tbt(run.gaps, run.wait)
            run.gaps = []
        while d.waiting and len(d.active) < load.max_batch and \
                d.reserved + d.waiting[0].reserve <= load.kv_capacity:
            run = d.waiting.popleft()
            load.waiting -= 1
            run.wait = now - run.wait  # was the time of the first token
            d.active[run.rid] = run
            load.starts[run.rid] = (now, int(run.kv))
            d.reserved += run.reserve
            load.kv_tokens += run.kv
        if not d.active and d.waiting:  # a sequence larger than the whole instance
            run = d.waiting.popleft()
            load.waiting -= 1
            run.outcome.rejected = "kv"
        load.running = len(d.active)
        if not d.active:
            load.kv_tokens = 0.0
        d.step = self.tm.decode_step_s(len(d.active), load.kv_tokens)
        d.version += 1
        if d.active:
            left = min(r.remaining for r in d.active.values())
            self._push(now + left * d.step, _DECODE_TICK, di, d.version)


def simulate(requests: Sequence[Request], config: SimConfig, policy: str,
             progress: Callable[[int, int], None] | None = None) -> SimResult:
    """Convenience: build a :class:`Simulator` for ``policy`` and run it."""
    return Simulator(config, policy).run(requests, progress)
