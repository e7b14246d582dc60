"""Leader election of store masters on etcd, with a fencing term (issue 10).

Keys of cluster C (``kvplane.store.etcd.HaAddress.key``):

* ``kvplane/C/leader``: ``{"addr", "term", "id"}`` of the leader, attached to its lease (TTL
  ``lease_ttl`` seconds, kept alive every third of it). Clients and segments read it.
* ``kvplane/C/term``: the last term handed out. A campaign is one transaction: *the leader key
  is absent and the term key is unchanged since I read it* -> put the leader key (with my lease)
  and term + 1. Two masters can never win the same term; the term is the new leader's epoch,
  so every generation it issues is newer than any a deposed leader issued.
* ``kvplane/C/segments``: the segments the leader serves, written (only while the leader key
  still holds its own value) when they change (checked every 0.1 s). A new leader waits for
  them to re-register before it answers misses (``MasterState.recover``), or for the whole
  recovery grace when there is no list.

No split brain: the leader counts its lease from *before* each keepalive was sent
(``leading_until``), so it ends no later than etcd's copy, and it stops answering
``margin`` seconds before that. Another master can only win after etcd expired the lease. A
deposed leader whose late answer still escapes is fenced by the term at the segments (their
listeners admit only the newest leader's generations) and by clients, which never follow a
lower term.

Threads: one named daemon thread runs the campaign / keepalive loop; callbacks run on it.
Imports ``kvplane.store.etcd``; binds no sockets.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable

from kvplane.common import log as klog
from kvplane.common.errors import KVPlaneError
from kvplane.store.etcd import Etcd, HaAddress, absent, holds, put_op, unchanged

log = logging.getLogger(__name__)
POLL = 0.25  # seconds between a standby's looks at the leader key


class Election:
    """One master's campaign for, and tenure of, the leadership of a cluster.

    Args:
        where: the etcd endpoints and cluster id.
        advertise: the RPC address clients should use for this master (``host:port``).
        lease_ttl: seconds of the leader lease (etcd rounds to whole seconds, at least 2).
        on_lead: called with (term, expected segment names or None) on winning.
        on_lose: called with the reason when the lease is lost.
        margin: seconds before the lease's end at which the leader stops answering.
        term_key: the etcd key of the term counter (default ``kvplane/C/term``); the shards
            of a sharded pool share one, so their terms (their epochs) never meet.
    """

    def __init__(self, where: HaAddress, advertise: str, lease_ttl: int,
                 on_lead: Callable[[int, set[str] | None], None],
                 on_lose: Callable[[str], None], margin: float = 0.3,
                 term_key: str | None = None) -> None:
        self.where = where
        self.term_key = term_key or where.key("term")
        self.ttl = max(2, int(lease_ttl))
        self.margin = margin
        self.advertise = advertise
        self._on_lead, self._on_lose = on_lead, on_lose
        self._etcd = Etcd(where.endpoints, timeout=min(1.0, self.ttl / 3))
        self.instance = secrets.token_hex(8)
        self.term = 0
        self.lease = 0
        self.leading_until = 0.0  # monotonic; 0 while standby
        self.leader = ""  # the address etcd names as leader (this one, or another)
        self.elections = 0
        self._value = ""
        self._published: tuple[str, ...] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="master-election", daemon=True)

    def start(self) -> Election:
        self._thread.start()
        return self

    def leading(self, now: float) -> bool:
        """True while this master may answer as leader (its lease minus the margin)."""
        return now < self.leading_until - self.margin

    # -- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                wait = self._keep() if self.leading_until else self._watch()
            except KVPlaneError as exc:
                log.warning("etcd: %s", exc)
                wait = 0.2
            if self.leading_until and time.monotonic() >= self.leading_until:
                self._lose("the lease ran out before etcd confirmed it")
            self._stop.wait(wait)

    def _watch(self) -> float:
        got = self._etcd.get(self.where.key("leader"))
        if got is None:
            self._campaign()
        else:
            self.leader = json.loads(got[0]).get("addr", "")
        return POLL

    def _campaign(self) -> None:
        term_key, leader_key = self.term_key, self.where.key("leader")
        cur = self._etcd.get(term_key)
        term = (int(cur[0]) if cur else 0) + 1
        start = time.monotonic()
        lease = self._etcd.grant(self.ttl)
        value = json.dumps({"addr": self.advertise, "term": term, "id": self.instance})
        won = self._etcd.txn([absent(leader_key), unchanged(term_key, cur[1] if cur else 0)],
                             [put_op(leader_key, value, lease), put_op(term_key, str(term))])
        if not won:
            self._revoke(lease)
            return
        self.term, self.lease, self._value = term, lease, value
        self.elections += 1
        self._published = None
        try:
            members = self._etcd.get(self.where.key("segments"))
        except KVPlaneError:
            self._revoke(lease)  # never led: hand the term over rather than sit on it
            raise
        expected = set(json.loads(members[0])) if members else None
        klog.event("master_elected", term=term, addr=self.advertise,
                   expected_segments=len(expected or ()))
        # the master switches to the new term's state and its recovery gate first; only then
        # does it answer as leader (before, a request in between got a miss from the standby's
        # state, never "Recovering"); the lease still counts from before the grant
        self._on_lead(term, expected)
        self.leading_until, self.leader = start + self.ttl, self.advertise

    def _keep(self) -> float:
        sent = time.monotonic()
        ttl = self._etcd.keepalive(self.lease)
        if ttl <= 0:
            self._lose("etcd says the lease expired")
            return POLL
        got = self._etcd.get(self.where.key("leader"))
        if got is None or got[0].decode() != self._value:
            self._lose("the leader key no longer names this master")
            return POLL
        self.leading_until = max(self.leading_until, sent + ttl)
        return self.ttl / 3

    def _lose(self, why: str) -> None:
        if not self.leading_until:
            return
        self.leading_until, self.leader = 0.0, ""
        klog.event("master_deposed", term=self.term, reason=why)
        self._on_lose(why)

    def _revoke(self, lease: int) -> None:
        try:
            self._etcd.revoke(lease)
        except KVPlaneError as exc:
            log.debug("revoking lease %s failed: %s", lease, exc)

    # -- called by the server --------------------------------------------------------------------
    def publish_segments(self, names: list[str]) -> None:
        """Record the segments this leader serves (no-op when unchanged or not leading)."""
        snap = tuple(sorted(names))
        if not self.leading_until or snap == self._published:
            return
        if self._etcd.txn([holds(self.where.key("leader"), self._value)],
                          [put_op(self.where.key("segments"), json.dumps(list(snap)))]):
            self._published = snap

    def close(self) -> None:
        """Stop campaigning; a leader gives its lease back, so a standby takes over at once."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        if self.leading_until:
            self.leading_until = 0.0
            self._revoke(self.lease)
        self._etcd.close()
