"""The master process: binds MasterState to the control RPC, runs the liveness/eviction timer,
and serves the admin HTTP API (Prometheus /metrics, /health, /query_key, /segments...).

With ``ha`` (an ``etcd://`` address) the master campaigns for the cluster's leadership
(``ha.Election``): a standby answers every RPC with ``NotLeader``; on winning it starts from an
empty state in the epoch of its term and takes over what the segments re-register, answering
misses with ``Recovering`` meanwhile; it stops answering as soon as its lease may have ended.
Without ``ha`` it leads alone, with a random epoch, and takes over what segments re-register
after a restart the same way.

Every RPC and admin request is authenticated (``kvplane.common.auth.TokenTable``: service,
admin and tenant tokens) and checked by ``access.Access`` (tenant namespaces, segment
ownership). The only module of the store master that binds sockets.

Handlers: the server's own (``_handlers``) and each RPC module's ``handlers(serving)``
(``replica_rpc``, ``tier_rpc``), registered once at start behind the lock, the counters and the
access checks (``add_handler``). RPC modules get a ``serving.Serving`` (the state and the clock),
never the server; a leader change swaps ``serving.state``. The top of the master's layers
(``tests/unit/test_layering.py``): nothing in the master imports this module.
"""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import FastAPI

from kvplane.common import envs, metrics
from kvplane.common import log as klog
from kvplane.common.auth import TokenTable
from kvplane.common.errors import KVPlaneError
from kvplane.common.http import ServerThread
from kvplane.common.rpc import RpcServer, after_reply
from kvplane.store import inventory
from kvplane.store.errors import (
    InvalidParams,
    NoAvailableHandle,
    NotLeader,
    ObjectNotFound,
    Recovering,
)
from kvplane.store.master import admin, repair, replica_rpc, spares, status, tier_rpc
from kvplane.store.master.access import Access, is_service, require_service
from kvplane.store.master.config import MasterConfig
from kvplane.store.master.grants import MasterGrants
from kvplane.store.master.pool_events import PoolEvents
from kvplane.store.master.serving import Handlers, Serving
from kvplane.store.master.state import MasterState
from kvplane.store.types import (
    AdoptReq,
    CodesRep,
    KeyResult,
    KeysReq,
    ListKeysRep,
    ListKeysReq,
    MountRep,
    MountReq,
    PingRep,
    PingReq,
    PutEndReq,
    PutStartReq,
    RegexReq,
    RemoveReq,
    RepairDoneReq,
    ResultsRep,
    Retire,
    Spare,
    SpareAsk,
)

if TYPE_CHECKING:  # imported when HA is on (it needs an etcd client)
    from kvplane.store.master.ha import Election

log = logging.getLogger(__name__)

KEYS = metrics.Gauge("master_key_count", "Objects held by the master")
ALLOCATED = metrics.Gauge("master_allocated_bytes", "Bytes allocated in mounted segments")
CAPACITY = metrics.Gauge("master_total_capacity_bytes", "Bytes of mounted segments")
CLIENTS = metrics.Gauge("master_active_clients", "Clients with a live heartbeat")
SEGMENTS = metrics.Gauge("master_mounted_segments", "Mounted segments")
EVICTED = metrics.Counter("master_evicted_key_count", "Objects evicted")
EXPIRED = metrics.Counter("master_expired_clients_total", "Clients dropped after their TTL")
RPCS = metrics.Counter("master_rpc_requests_total", "Master RPCs served", ["method"])
SHORT = metrics.Gauge("master_under_replicated_keys", "Objects holding fewer replicas than asked for")
FENCES = metrics.Gauge("master_pending_fences", "Freed allocations waiting for their segment's fence")
SUSPECTS = metrics.Gauge("master_suspected_segments", "Segments a client reported failing")
REPAIRED = metrics.Counter("master_repaired_replicas_total", "Replicas re-created by re-replication")
LEADER = metrics.Gauge("master_is_leader", "1 while this master leads (always, without HA)")
TERM = metrics.Gauge("master_term", "The leader term (HA) this master serves in")
RECOVERING = metrics.Gauge("master_recovering", "1 while misses wait for segments to re-register")
ADOPTED = metrics.Gauge("master_adopted_replicas", "Replicas re-registered from segments' records")
FORGETS = metrics.Gauge("master_pending_forgets", "Freed headers the segments have not cleared yet")

TICK = 0.1  # seconds between liveness / eviction / reclaim passes
MAX_AHEAD = 4096  # clients with a spare placed ahead (``MasterServer._place_ahead``)
PRUNE_AHEAD_EVERY = 50  # timer passes between two looks at those spares (5 s)
STEP = 0.002  # seconds a step of a long pass (eviction, an unmount's sweep, repair planning)
# aims to hold the lock; between steps the lock is free for the RPCs
STEP_GAP = 0.0005  # seconds the timer leaves the lock free between two steps, at least ...
YIELD_MAX = 0.02  # ... and at most, while RPCs wait for the lock
LEASE_POLL = 0.5  # seconds at most between a put's asks while read leases keep memory full
RETRY_AFTER = 0.05  # seconds a put that found memory full of objects being offloaded waits


class Extension(Protocol):
    """A part a master plays beside the store (a shard of a sharded pool:
    ``kvplane.store.shard.role.ShardRole``): more RPCs, and a check before every RPC."""

    def handlers(self, serving: Serving) -> Handlers:
        """Its RPCs, registered like the store's (under the lock, counted, access-checked)."""
        ...

    def check(self, method: str, request: Any) -> None:
        """Run under the lock before ``method``'s handler (after the leader check); raises to
        refuse the call (a key of a hash slot this shard does not serve)."""
        ...

    def status(self, doc: dict[str, Any], admin: bool, with_history: bool) -> dict[str, Any]:
        """The ``/status`` document as served (a shard answers for its whole pool); called
        outside the lock."""
        ...


class MasterServer:
    """A running master: RPC on ``port``, admin HTTP on ``admin_port`` (None: no HTTP).

    Args:
        config: master semantics (leases, TTLs, watermarks, placement).
        host: bind address for both listeners.
        port: RPC port (Mooncake default 50051; 0 picks one).
        admin_port: admin/metrics HTTP port (Mooncake default 9003; 0 picks one; None disables).
        token: the service token for RPC, admin HTTP and KV events ("" = no authentication);
            it also keys the inventory headers' tags.
        clock: monotonic clock (tests may inject one).
        kv_events_port: publish KV events on this ZMQ port (0 picks one; None: off).
        tenants: tenant name -> token; each tenant sees only its own keys.
        admin_token: the admin token (unmounts anyone's segment, lists any tenant).
        ha: ``etcd://h1:2379;h2:2379[/CLUSTER]``: campaign for the leadership of that cluster.
        cluster: the cluster id (overrides the one in ``ha``).
        advertise: the address clients reach this master at (default ``host:port``).
        lease_ttl: HA leader lease, seconds.
        extensions: parts played beside the store (``Extension``: a shard's role).
        term_key: HA: the etcd key of the term counter (``ha.Election``; a sharded pool's
            shards share one).
        lone_epoch: draws the epoch of a master that leads alone or stands by (default: 23
            random bits; a shard's keep its id in the low bits, so shards never share one).
    """

    def __init__(self, config: MasterConfig | None = None, host: str = "127.0.0.1", port: int = 0,
                 admin_port: int | None = 0, token: str = "",
                 clock: Callable[[], float] = time.monotonic,
                 kv_events_port: int | None = None, tenants: dict[str, str] | None = None,
                 admin_token: str = "", ha: str | None = None, cluster: str | None = None,
                 advertise: str | None = None, lease_ttl: int = 3,
                 extensions: Sequence[Extension] = (), term_key: str | None = None,
                 lone_epoch: Callable[[], int] | None = None) -> None:
        self.config = config or MasterConfig()
        self._secret = inventory.secret_of(token)
        self._lone_epoch = lone_epoch or (lambda: secrets.randbits(23) | 1)
        self.state = self._fresh_state(self._lone_epoch())  # epoch: new on every start
        self.serving = Serving(self.state, clock)  # what the RPC modules and access checks see
        self._evicted_seen = 0
        self.auth = TokenTable(token, admin_token, tenants)
        self.access = Access(self.serving)
        self.access.grants = MasterGrants(self._secret, tenants or {}, clock)
        self.events: PoolEvents | None = None
        if kv_events_port is not None:
            self.events = PoolEvents(host, kv_events_port, auth=self.auth)
        self.clock = clock
        self.lock = threading.Lock()
        # per client: the spare placed for it after its last PutEnd's answer (name, version,
        # the shape it was asked in), handed out by its next PutEnd (``_spare``)
        self._ahead: dict[str, tuple[str, int, SpareAsk]] = {}
        self._ticks = 0
        self._waiting = 0  # RPCs blocked on the lock (a step of a long pass lets them in first)
        self._waiting_lock = threading.Lock()
        self.rpc_calls: dict[str, int] = {}  # RPCs served, by method
        self._published: dict[str, int] = {}  # of those, what the Prometheus counter has
        self.key_ops: dict[str, int] = {}  # keys those RPCs named, by method (the status view's ops)
        self.history = status.History()
        self.started = (clock(), time.time())
        self.extras: dict[str, Any] = {}  # more top-level /status fields (kvplane serve's fabric)
        # a put's PutEnd comes one write after the last call of its client: poll for it
        # bound now (the port is known), listening only from rpc.start(), once every handler is
        # in: before that a client's connect is refused and retried, never answered "unknown"
        self.rpc = RpcServer(host, port, authenticate=self.auth,
                             spin=envs.get("KVPLANE_MASTER_SPIN"), listen=False)
        self.port = self.rpc.port
        self._checks = [e.check for e in extensions]
        self._extensions = list(extensions)
        for table in (self._handlers(), replica_rpc.handlers(self.serving),
                      tier_rpc.handlers(self.serving),
                      *(e.handlers(self.serving) for e in extensions)):
            for name, (fn, typ) in table.items():
                self.add_handler(name, fn, typ)
        self.rpc.start()
        self.host = host
        self.election: Election | None = None
        if ha:
            self.election = self._election(ha, cluster, advertise or f"{host}:{self.port}",
                                           lease_ttl, term_key)
        self._stop = threading.Event()
        self._timer = threading.Thread(target=self._tick_loop, name="master-timer", daemon=True)
        self._timer.start()
        self.http: ServerThread | None = None
        if admin_port is not None:
            self.http = ServerThread(self.admin_app(), host, admin_port, authenticate=self.auth,
                                     name="master-admin")
        if self.election is not None:
            self.election.start()
        klog.event("master_started", port=self.port, ha=bool(ha),
                   admin_port=self.http.port if self.http else None)

    # -- roles -----------------------------------------------------------------------------------
    def _election(self, ha: str, cluster: str | None, advertise: str, lease_ttl: int,
                  term_key: str | None) -> Election:
        from kvplane.store.etcd import HaAddress
        from kvplane.store.master.ha import Election

        return Election(HaAddress.parse(ha, cluster), advertise, lease_ttl, self._elected,
                        self._deposed, term_key=term_key)

    def _fresh_state(self, epoch: int) -> MasterState:
        state = MasterState(self.config, epoch=epoch)
        state.secret = self._secret
        return state

    def leading(self, now: float | None = None) -> bool:
        """True while this master may answer (always without HA)."""
        if self.election is None:
            return True
        return self.election.leading(time.monotonic() if now is None else now)

    @property
    def role(self) -> str:
        return "leader" if self.leading() else "standby"

    def _elected(self, term: int, expected: set[str] | None) -> None:
        """Won the term: serve from an empty state in its epoch (the election thread)."""
        with self.lock:
            self._switch(self._fresh_state(term))
            self._evicted_seen = 0
            # misses wait for the segments the last leader listed, or (no list: it died before
            # publishing one) the whole grace
            self.state.recover(self.clock(), self.config.recovery_grace, expected)

    def _deposed(self, why: str) -> None:
        """Lost the lease: forget everything (a standby holds no state)."""
        log.warning("no longer the leader: %s", why)
        with self.lock:
            self._switch(self._fresh_state(self._lone_epoch()))

    def _switch(self, state: MasterState) -> None:
        """Serve ``state`` from now on (under the lock): handlers, access checks and tasks."""
        self.state = state
        self.serving.state = state

    # -- rpc handlers (each under the state lock) --------------------------------------------
    def _handlers(self) -> Handlers:
        """The server's own RPCs (the replica and SSD-tier ones come from their modules)."""
        return {
            "mount": (self._mount, MountReq), "unmount": (self._unmount, MountReq),
            "ping": (self._ping, PingReq), "put_start": (self._put_start, PutStartReq),
            "put_end": (self._put_end, PutEndReq), "put_revoke": (self._put_revoke, PutEndReq),
            "get_replicas": (self._get_replicas, KeysReq), "exist": (self._exist, KeysReq),
            "get_size": (self._get_size, KeysReq), "remove": (self._remove, RemoveReq),
            "remove_regex": (self._remove_regex, RegexReq),
            "remove_all": (self._remove_all, RegexReq),
            "repair_done": (self._repair_done, RepairDoneReq), "adopt": (self._adopt, AdoptReq),
            "list_keys": (self._list_keys, ListKeysReq), "whoami": (self.access.whoami, str),
        }

    def add_handler(self, name: str, fn: Callable[[Any], Any], request_type: type[Any]) -> None:
        """Serve ``name`` with ``fn(request)`` under the state lock (counted like the others),
        behind the access checks (tenant key scoping, ownership)."""
        self.rpc.add(name, self._counted(name, self.access.guard(name, fn)), request_type)

    def _counted(self, name: str, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``fn`` under the lock, counted in ``rpc_calls`` and ``key_ops`` (plain ints: the
        Prometheus counter takes them on the timer's pass, ``_publish_calls``)."""
        calls, key_ops, lock = self.rpc_calls, self.key_ops, self.lock

        def handler(req: Any) -> Any:
            if not lock.acquire(blocking=False):  # held: say so (the timer's steps yield)
                with self._waiting_lock:
                    self._waiting += 1
                lock.acquire()
                with self._waiting_lock:
                    self._waiting -= 1
            try:
                if self.election is not None and not self.leading():
                    raise NotLeader(f"not the leader; etcd names {self.election.leader or 'none'}")
                for check in self._checks:  # a shard: keys of slots it does not serve
                    check(name, req)
                calls[name] = calls.get(name, 0) + 1
                keys = getattr(req, "keys", None)
                key_ops[name] = key_ops.get(name, 0) + (
                    len(keys) if isinstance(keys, list) else 1)
                try:
                    return fn(req)
                finally:
                    if self.state.changes:
                        self._flush_changes()
            finally:
                lock.release()
        return handler

    def _publish_calls(self) -> None:
        """Add the RPCs served since the last pass to ``master_rpc_requests_total`` (under the
        lock): one counter update per method and pass, not one per call."""
        for name, n in self.rpc_calls.items():
            done = self._published.get(name, 0)
            if n > done:
                RPCS.labels(name).inc(n - done)
                self._published[name] = n

    def _flush_changes(self) -> None:
        """Publish (or, with events off, drop) what the last call changed. Under the lock."""
        if self.state.changes:
            if self.events is not None:
                self.events.publish(self.state.changes)
            self.state.changes = []

    def _gate(self, now: float, missed: bool) -> None:
        """While recovering, a miss may be an object not re-registered yet: retry it."""
        if missed and self.state.recovering(now):
            raise Recovering("segments are still re-registering their objects")

    def _mount(self, req: MountReq) -> MountRep:
        """The epoch and floor: the segments refuse data frames of any other, or older."""
        now = self.clock()
        st = self.state
        floor = st.mount(req.client_id, req.segments, now, adopt=req.adopt)
        st.view_version += 1
        if req.adopt and self.election is None and (not st.gate_until or st.recovering(now)):
            # a lone master learns it restarted from the first segment that remounts; each
            # further one that arrives while it recovers extends the wait
            st.recover(now, self.config.recovery_grace, None)
        return MountRep(st.epoch, floor, self._secret if req.segments else b"")

    def _adopt(self, req: AdoptReq) -> list[int]:
        return self.state.adopt(req.client_id, req.segment, req.records, req.history, req.done,
                                self.clock())

    def _unmount(self, req: MountReq) -> int:
        for s in req.segments:  # the timer sweeps its replicas out of their objects in steps
            self.state.unmount_start(s.name)  # its copy/move task allocations go with it
        return 0

    def _ping(self, req: PingReq) -> PingRep:
        now = self.clock()
        st = self.state
        st.suspect(req.suspects, now)
        status = st.ping(req.client_id, now, req.fenced, req.forgot)
        if req.retired:
            st.retired(req.retired)
        return PingRep(status, st.view_version, st.fences_for(req.client_id),
                       st.repairs.take(req.client_id), st.forgets_for(req.client_id))

    def _repair_done(self, req: RepairDoneReq) -> int:
        now = self.clock()
        joined = sum(self.state.repairs.done(k, g, ok, now)
                     for k, g, ok in zip(req.keys, req.gens, req.ok, strict=True))
        REPAIRED.inc(joined)
        return joined

    def _local(self, client_id: str) -> frozenset[str]:
        client = self.state.clients.get(client_id)
        if client is None:
            return frozenset()
        hosts = {self.state.segments[s].info.host_id for s in client.segments
                 if s in self.state.segments}
        return frozenset(n for n, s in self.state.segments.items() if s.info.host_id in hosts)

    def _put_start(self, req: PutStartReq) -> ResultsRep:
        now = self.clock()
        self._gate(now, True)
        local = self._local(req.client_id) if req.config.prefer_alloc_in_same_node else frozenset()
        window = self.state.write_window(req.ttl)
        sums = req.checksums or [0] * len(req.keys)
        if req.retired:  # before placing: that space may serve this very call
            self.state.retired(req.retired)
        self._give_back(req.client_id, req.returns, now)  # so may that of spares given back
        rows = list(zip(req.keys, req.sizes, sums, strict=True))
        retire: list[Retire] = []  # an upsert that replaced a leased object retires it
        one = self._retiring_each(
            lambda i: self.state.put_start(rows[i][0], rows[i][1], req.config, now, req.upsert,
                                           local, req.client_id, window, rows[i][2], req.nonce,
                                           owner=req.client_id),  # Mooncake's client_id
            retire)
        if req.upsert or local:
            results = [one(i) for i in range(len(rows))]
        else:  # the common batch of fresh keys: the per-call work once (the same answers)
            results = self.state.put_start_many(req.keys, req.sizes, sums, req.config, now,
                                                req.client_id, window, req.nonce, one)
        out = ResultsRep(results, window, retire=retire or None)
        if any(r.code == NoAvailableHandle.code for r in out.results):
            out.retry_after = self._retry_after(now)
        return out

    def _retry_after(self, now: float) -> float:
        """How long a put that found no room waits before asking again (0: fail now): offloads
        under way will make room soon; else read leases that end free their objects for
        eviction, so wait for the first to end (at most ``LEASE_POLL`` between asks)."""
        if self.state.tiers.offloads:
            return RETRY_AFTER
        wait = self.state.lease_wait(now)
        return min(max(wait, RETRY_AFTER), LEASE_POLL) if wait > 0 else 0.0

    def _retiring(self, op: Callable[[int], Any], n: int) -> tuple[list[Any], list[Retire]]:
        """``op(i)`` for each key index, and the replicas each one dropped under a read lease
        (``MasterState.retiring``) as ``Retire`` entries for the caller."""
        retire: list[Retire] = []
        each = self._retiring_each(op, retire)
        return [each(i) for i in range(n)], retire

    def _retiring_each(self, op: Callable[[int], Any],
                       retire: list[Retire]) -> Callable[[int], Any]:
        """``op`` that adds to ``retire`` the replicas each call of it dropped under a read
        lease (for callers that call it key by key themselves)."""
        retiring = self.state.retiring
        retiring.clear()

        def each(i: int) -> Any:
            out = op(i)
            if retiring:
                retire.extend((i, r.segment, r.gen) for r in retiring)
                retiring.clear()
            return out
        return each

    def _put_end(self, req: PutEndReq) -> CodesRep:
        puts = self.state.puts
        try:
            return self._commit(req)
        finally:  # the status view's put count: objects committed, plain or spare, once each
            self.key_ops[status.COMMITTED] = (self.key_ops.get(status.COMMITTED, 0)
                                              + self.state.puts - puts)

    def _commit(self, req: PutEndReq) -> CodesRep:
        now = self.clock()
        self.state.suspect(req.suspects, now)
        sums = req.checksums or [0] * len(req.keys)
        rows = zip(req.keys, req.versions, sums, strict=True)
        if req.renames:  # written into spares: each spare becomes its key, the writer's
            require_service("a commit of spares")
            codes = [spares.commit(self.state, req.client_id, n, k, v, c, now)
                     for n, (k, v, c) in zip(req.renames, rows, strict=True)]
        else:
            codes = [self.state.put_end(k, now, v, c) for k, v, c in rows]
            self._gate(now, ObjectNotFound.code in codes)
        self._give_back(req.client_id, req.returns, now)
        out = CodesRep(codes)
        if req.spare is not None and is_service() and not self.state.recovering(now):
            out.spare = self._spare(req.client_id, req.spare, now)
        elif self._ahead:
            self._drop_ahead(req.client_id, now)  # it stopped asking: its next spare goes
        return out

    def _spare(self, client_id: str, ask: SpareAsk, now: float) -> Spare | None:
        """The spare for ``client_id``'s next put: the one placed for it after its last
        PutEnd was answered (``_ahead``), handed out as if placed now, else one placed now;
        and, once this answer is sent, the one after it (``_place_ahead``)."""
        local = (self._local(client_id) if ask.config.prefer_alloc_in_same_node
                 else frozenset())
        window = self.state.write_window(0.0)
        got = self._take_ahead(client_id, ask, now, window)
        if got is None:
            got = spares.grant(self.state, client_id, ask, now, local, window)
            if got is None:
                return None
        after_reply(functools.partial(self._place_ahead, client_id, ask, local, window))
        return Spare(got[0], got[1], window, self._secret)

    def _take_ahead(self, client_id: str, ask: SpareAsk, now: float, window: float
                    ) -> tuple[str, KeyResult] | None:
        """The spare placed ahead for ``client_id``, renewed, if it fits ``ask`` and is still
        there; one that does not fit is freed."""
        held = self._ahead.get(client_id)
        if held is None:
            return None
        if held[2] != ask:
            self._drop_ahead(client_id, now)
            return None
        name, version, _ = self._ahead.pop(client_id)
        got = spares.renew(self.state, client_id, name, version, now, window)
        return None if got is None else (name, got)

    def _place_ahead(self, client_id: str, ask: SpareAsk, local: frozenset[str],
                     window: float) -> None:
        """After a PutEnd's answer: place ``client_id``'s next spare but one, so that its next
        PutEnd hands one out without placing it (the placement is off the put's path). At
        most one per client, ``MAX_AHEAD`` in all."""
        with self.lock:
            now = self.clock()
            if (client_id in self._ahead or len(self._ahead) >= MAX_AHEAD
                    or self.state.recovering(now) or not self.leading()):
                return
            got = spares.grant(self.state, client_id, ask, now, local, window)
            if got is not None:
                self._ahead[client_id] = (got[0], got[1].version, ask)

    def _drop_ahead(self, client_id: str, now: float) -> None:
        """Free the spare placed ahead for ``client_id`` (never handed out: never written)."""
        held = self._ahead.pop(client_id, None)
        if held is not None:
            spares.give_back(self.state, client_id, held[0], held[1], False, now)

    def _prune_ahead(self) -> None:
        """Forget the spares placed ahead that are gone: their client died (an unfinished put
        of a dead writer goes by the usual rules), their segment went, a new state. Under the
        lock; the timer's pass, every ``PRUNE_AHEAD_EVERY`` passes."""
        for cid, (name, version, _) in list(self._ahead.items()):
            if not spares.unwritten(self.state, cid, name, version):
                del self._ahead[cid]

    def _give_back(self, client_id: str, returns: list[tuple[str, int, bool]],
                   now: float) -> None:
        """Spares a client gives back with a put call (not the put's own keys)."""
        if returns:
            require_service("a return of spares")
            for name, version, written in returns:
                spares.give_back(self.state, client_id, name, version, written, now)

    def _put_revoke(self, req: PutEndReq) -> CodesRep:
        now = self.clock()
        self.state.suspect(req.suspects, now)
        self._give_back(req.client_id, req.returns, now)
        return CodesRep([self.state.put_revoke(k, now, v)
                         for k, v in zip(req.keys, req.versions, strict=True)])

    def _get_replicas(self, req: KeysReq) -> ResultsRep:
        now = self.clock()
        self.state.suspect(req.suspects, now)
        stale = None
        if req.expect is not None:
            if len(req.expect) != len(req.keys):
                raise InvalidParams("expect must give one location (or null) per key")
            stale, results = self.state.confirm_many(req.keys, req.expect, now)
        else:
            cols = self.state.columns_many(req.keys, now) if req.columns else None
            if cols is not None:  # every key found: nothing for the recovery gate
                return ResultsRep([], self.state.config.lease_ttl, columns=cols)
            results = self.state.get_replicas_many(req.keys, now)
        self._gate(now, any(r.code == ObjectNotFound.code for r in results))
        return ResultsRep(results, self.state.config.lease_ttl, stale=stale)

    def _exist(self, req: KeysReq) -> CodesRep:
        now = self.clock()
        st = self.state
        st.suspect(req.suspects, now)
        if req.columns and is_service():  # the places too, under the lease exist grants
            cols = st.columns_many(req.keys, now)  # (None: a key missing, or not plain)
            if cols is not None:
                return CodesRep([1] * len(req.keys), columns=cols, ttl=st.config.lease_ttl)
        codes = [st.exist(k, now) for k in req.keys]
        self._gate(now, 0 in codes)
        return CodesRep(codes)

    def _get_size(self, req: KeysReq) -> CodesRep:
        out = []
        for k in req.keys:
            obj = self.state.objects.get(k)
            out.append(obj.size if obj is not None and obj.complete else ObjectNotFound.code)
        self._gate(self.clock(), ObjectNotFound.code in out)
        return CodesRep(out)

    def _remove(self, req: RemoveReq) -> CodesRep:
        now = self.clock()
        codes, retire = self._retiring(lambda i: self.state.remove(req.keys[i], req.force, now),
                                       len(req.keys))  # forced while leased: retired
        self._gate(now, ObjectNotFound.code in codes)
        return CodesRep(codes, retire or None)

    def _remove_regex(self, req: RegexReq) -> int:
        self._gate(self.clock(), True)
        return self.access.remove_regex(req.pattern, req.force, self.clock())

    def _remove_all(self, req: RegexReq) -> int:
        self._gate(self.clock(), True)
        return self.access.remove_all(req.force, self.clock())

    def _list_keys(self, req: ListKeysReq) -> ListKeysRep:
        """A page of the caller's complete keys (``Access.list_keys``: bounded per answer)."""
        self._gate(self.clock(), True)  # segments still re-registering: the list is not whole
        return self.access.list_keys(req)

    # -- background --------------------------------------------------------------------------------
    def _tick_loop(self) -> None:
        while not self._stop.wait(TICK):
            try:
                self.tick()
            except Exception:  # keep the timer alive; count and back off through the tick
                log.exception("master timer pass failed")

    def tick(self) -> None:
        """One liveness + reclaim + eviction pass, and a metrics refresh (while leading)."""
        leading = self.leading()
        LEADER.set(1 if leading else 0)
        with self.lock:
            self._publish_calls()
        if not leading:
            return
        with self.lock:
            now = self.clock()
            st = self.state
            for cid in st.expire_clients(now, sweep=False):
                EXPIRED.inc()
                klog.event("client_expired", client_id=cid)
            self._ticks += 1
            if self._ahead and self._ticks % PRUNE_AHEAD_EVERY == 0:
                self._prune_ahead()
            st.reclaim(now)
            replica_rpc.tick(self.serving)
            st.repairs.expire(now)
        self._long_passes(st)
        with self.lock:
            if self.state is not st:
                return
            now = self.clock()
            # every eviction counts, also those a failed allocation triggered inside put_start
            EVICTED.inc(st.evicted - self._evicted_seen)
            self._evicted_seen = st.evicted
            st.tiers.expire(now)
            st.tiers.plan(now)
            tier_rpc.gauges(st)
            self._flush_changes()
            self._gauges(now)
            if self.history.due(now):
                self.history.add(status.sample(st, self.key_ops, now, time.time()))
            names = [n for n, seg in st.segments.items() if not seg.adopting]
        if self.election is not None:
            try:  # outside the lock: an etcd round trip
                self.election.publish_segments(names)
            except KVPlaneError as exc:
                log.debug("publishing the segment list failed: %s", exc)

    def _long_passes(self, st: MasterState) -> None:
        """The passes that may touch millions of objects, each in steps that hold the lock for
        about ``STEP`` seconds: unmounted segments' sweeps, an eviction pass, repair planning
        (up to ``repair.SCAN`` short objects)."""
        for sweep in list(st.sweeps):
            self._in_steps(st, functools.partial(st.sweep_step, sweep))
        with self.lock:
            job = st.evict_start() if self.state is st else None
        if job is not None:
            self._in_steps(st, lambda n: st.evict_step(job, self.clock(), n))
            if job.count:
                klog.event("evicted", count=job.count)
        plan = repair.PlanPass()
        self._in_steps(st, lambda n: st.repairs.plan_step(plan, self.clock(), n))

    def _in_steps(self, st: MasterState, step: Callable[[int], bool]) -> None:
        """Run ``step(budget)`` under the lock until it returns True (done), the lock free for
        ``STEP_GAP`` between steps; ``budget`` (objects a step may handle) adapts so that a
        step holds the lock for about ``STEP``. Stops when the state is replaced (a new
        term) or the server closes."""
        budget = 32  # (small: the first step learns what one object costs)
        while not self._stop.is_set():
            with self.lock:
                if self.state is not st:
                    return
                t0 = time.perf_counter()
                done = step(budget)
                took = time.perf_counter() - t0
            if done:
                return
            # at most twice the last (a run of cheap objects must not make the next step long)
            budget = max(16, min(1 << 16, 2 * budget, int(budget * STEP / max(took, 1e-5))))
            self._let_waiters_in()

    def _let_waiters_in(self) -> None:
        """Between two steps: leave the lock free until the RPCs that wait for it had it
        (at most ``YIELD_MAX``). A plain sleep is not enough on a busy machine: the lock is not
        fair, and a waiter that is not scheduled in time loses it to the next step again."""
        deadline = time.perf_counter() + YIELD_MAX
        time.sleep(STEP_GAP)
        while self._waiting and time.perf_counter() < deadline:
            time.sleep(STEP_GAP)

    def _gauges(self, now: float) -> None:
        st = self.state
        segs = st.segments.values()
        SHORT.set(st.repairs.under_replicated())
        FENCES.set(st.graveyard.pending_fences())
        SUSPECTS.set(sum(1 for s in segs if s.suspect_since is not None))
        KEYS.set(len(st.objects))
        ALLOCATED.set(st.usage.used)
        CAPACITY.set(st.usage.capacity)
        CLIENTS.set(len(st.clients))
        SEGMENTS.set(len(st.segments))
        TERM.set(st.epoch if self.election is not None else 0)
        RECOVERING.set(1 if st.recovering(now) else 0)
        ADOPTED.set(st.adoption.adopted)
        FORGETS.set(st.adoption.pending())

    # -- admin http -----------------------------------------------------------------------------
    def admin_app(self) -> FastAPI:
        """Mooncake-style admin API (read-only views, scoped by the caller's token), with the
        HA role in ``/health`` and ``/ha_status``."""
        return admin.build(lambda: self.state, self.lock, self.status, self.ha_status)

    def ha_status(self) -> dict[str, Any]:
        """Role, term, leader address, epoch, recovering (``/ha_status``)."""
        e = self.election
        with self.lock:
            recovering = self.state.recovering(self.clock())
        return {"role": self.role, "ha": e is not None, "term": e.term if e else 0,
                "leader": e.leader if e else f"{self.rpc.host}:{self.port}",
                "epoch": self.state.epoch, "recovering": recovering,
                "elections": e.elections if e else 0}

    def status(self, admin: bool = False, with_history: bool = False,
               extend: bool = True) -> dict[str, Any]:
        """The ``/status`` document (``kvplane.store.master.status``): segments, objects,
        evictions, ops and their rates; ``admin`` adds segment owners; ``extend``: as the
        extensions serve it (a shard's: the whole pool's), else this master's own."""
        with self.lock:
            now = self.clock()
            ident = {"address": f"{self.host}:{self.port}",
                     "admin_port": self.http.port if self.http else None,
                     "uptime_s": round(now - self.started[0], 3),
                     "started_at": round(self.started[1], 3), "role": self.role}
            doc = status.document(self.state, self.history, self.key_ops, self.rpc_calls, now,
                                  time.time(), ident, admin=admin, with_history=with_history)
        doc = {**doc, **self.extras}
        for ext in self._extensions if extend else ():
            doc = ext.status(doc, admin, with_history)
        return doc

    def close(self) -> None:
        """Stop the timer, RPC and HTTP (idempotent); a leader hands its lease back."""
        self._stop.set()
        if self.election is not None:
            self.election.close()
        self.rpc.close()
        if self.http is not None:
            self.http.close()
            self.http = None
        self._timer.join(2)
        if self.events is not None:
            self.events.close()
            self.events = None

    def __enter__(self) -> MasterServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
