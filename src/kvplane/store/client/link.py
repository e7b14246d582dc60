"""MasterLink: how a store client reaches the master, and follows it through failovers.

The master address is a plain ``host:port`` (one master) or ``etcd://h1:2379;h2:2379[/CLUSTER]``
(HA: the leader is whoever holds the cluster's leader key in etcd). Every call carries one
deadline. Within it, a call is retried when it surely changed nothing or is safe to repeat
(the master's RPCs are idempotent for a repeated request: a PutStart carries a nonce):

* ``NotLeader`` (a standby, or a leader whose lease ran out) and connection failures: ask etcd
  who leads now (HA), then retry;
* ``Recovering`` (a new leader still re-registering what segments hold): retry;
* HA only: an attempt gets at most ``attempt_timeout`` seconds, so a partitioned leader that
  never answers costs one attempt, not the whole deadline.

Nothing is retried past the deadline; the last error is raised then. Imports the RPC client,
``kvplane.store.etcd`` (etcd3gw only for etcd addresses) and ``timing``; binds no sockets.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvplane.common.deadline import Deadline
from kvplane.common.errors import Timeout, Unavailable
from kvplane.common.rpc import RpcClient
from kvplane.store.client.timing import coarse
from kvplane.store.errors import NotLeader, Recovering
from kvplane.store.etcd import Etcd, HaAddress, is_ha

log = logging.getLogger(__name__)
T = TypeVar("T")
BACKOFF = (0.02, 0.25)  # first and longest pause between attempts, seconds
RESOLVE_EVERY = 0.1  # seconds between two etcd lookups of the leader


class MasterLink:
    """The client's connection to the (leading) master. Thread-safe.

    Args:
        address: ``host:port`` or ``etcd://h1:2379;h2:2379[/CLUSTER]``.
        token: the token presented to the master.
        timeout: default deadline of a call, seconds.
        attempt_timeout: HA only: the longest single attempt.
    """

    def __init__(self, address: str, token: str = "", timeout: float = 5.0,
                 attempt_timeout: float = 1.0) -> None:
        self.address = address
        self.ha = is_ha(address)
        self._token, self._timeout, self._attempt = token, timeout, attempt_timeout
        self._lock = threading.Lock()
        self._etcd: Etcd | None = None
        self._where: HaAddress | None = None
        self._rpc: RpcClient | None = None
        self._resolved_at = 0.0
        self.leader = ""  # the master address in use
        self.term = 0  # HA: the highest leader term seen (the epochs of stale leaders are lower)
        self.failovers = 0  # times the leader in use changed
        if self.ha:
            self._where = HaAddress.parse(address)
            self._etcd = Etcd(self._where.endpoints, timeout=min(1.0, timeout))
        else:
            self._rpc = RpcClient(address.removeprefix("tcp://"), token, timeout)
            self.leader = self._rpc.endpoint

    # -- leader ------------------------------------------------------------------------------
    def _resolve(self, deadline: Deadline) -> RpcClient:
        """The RPC client of the current leader (asks etcd when none is known)."""
        with self._lock:
            if self._rpc is not None:
                return self._rpc
            if not self.ha:  # closed (a shard's link, closed while a heartbeat still ran)
                raise Unavailable(f"the link to master {self.address} is closed")
            wait = self._resolved_at + RESOLVE_EVERY - time.monotonic()
        if wait > 0:
            time.sleep(min(wait, deadline.remaining()))
        assert self._etcd is not None and self._where is not None
        got = self._etcd.get(self._where.key("leader"))
        with self._lock:
            self._resolved_at = time.monotonic()
            if self._rpc is not None:  # another thread resolved it meanwhile: share that one
                return self._rpc
            if got is None:
                raise NotLeader(f"no master leads cluster {self._where.cluster!r} yet")
            view = json.loads(got[0])
            if int(view["term"]) < self.term:  # never follow a leader older than one we saw
                raise NotLeader(f"etcd names term {view['term']}, older than {self.term}")
            if view["addr"] != self.leader:
                if self.leader:
                    self.failovers += 1
                self.leader = view["addr"]
                log.info("store master leader: %s (term %s)", self.leader, view["term"])
            self.term = int(view["term"])
            self._rpc = RpcClient(self.leader, self._token, self._timeout)
            return self._rpc

    def _forget(self, rpc: RpcClient) -> None:
        """Drop the leader in use (HA): the next call asks etcd again."""
        if not self.ha:
            return
        with self._lock:
            if self._rpc is rpc:
                self._rpc = None
        rpc.close()

    def saw_epoch(self, epoch: int) -> None:
        """A master answered with its epoch (= its term, in HA)."""
        if self.ha and epoch > self.term:
            with self._lock:
                self.term = max(self.term, epoch)

    # -- calls -------------------------------------------------------------------------------
    def call(self, method: str, request: Any, reply_type: type[T], timeout: float | None = None,
             once: bool = False, meanwhile: Callable[[], None] | None = None) -> T:
        """Call ``method`` on the leading master, retrying within ``timeout`` (see module doc).

        ``once``: a single attempt (a health probe). ``meanwhile``: run by the first attempt
        that sends its request, between the send and the reply (``RpcClient.call``); at most once.

        Raises:
            Timeout, Unavailable, NotLeader, Recovering: no master answered in time.
            KVPlaneError: the master's own error for this request.
        """
        deadline = Deadline.after(self._timeout if timeout is None else timeout)
        pause = BACKOFF[0]

        def first() -> None:  # ``meanwhile``, by the first attempt that gets to it
            nonlocal meanwhile
            fn, meanwhile = meanwhile, None
            if fn is not None:
                fn()

        while True:
            rpc = None
            try:
                rpc = self._resolve(deadline)
                left = deadline.remaining()
                if left <= 0:
                    raise Timeout(f"store {method}: no time left to reach the master")
                per = min(left, self._attempt) if self.ha else left
                if meanwhile is None:
                    return rpc.call(method, request, reply_type, timeout=coarse(per))
                return rpc.call(method, request, reply_type, timeout=coarse(per), meanwhile=first)
            except (NotLeader, Recovering, Unavailable, Timeout) as exc:
                if rpc is not None and not isinstance(exc, Recovering):
                    self._forget(rpc)
                if once or deadline.remaining() <= pause or \
                        (isinstance(exc, Timeout) and not self.ha):
                    raise
                log.debug("store %s: %s; retrying", method, exc)
            time.sleep(pause)
            pause = min(pause * 2, BACKOFF[1])

    def close(self) -> None:
        """Close the connection and the etcd client (idempotent)."""
        with self._lock:
            rpc, self._rpc = self._rpc, None
        if rpc is not None:
            rpc.close()
        if self._etcd is not None:
            self._etcd.close()
