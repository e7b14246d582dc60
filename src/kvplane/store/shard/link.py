"""ShardedLink: a store client's link to a sharded pool, with the interface of ``MasterLink``.

The client's layers call ``link.call(method, request, reply_type, ...)`` as they would on one
master (``kvplane.store.client.link.MasterLink``); this link routes each call by the shard map
(``slots.py``), over one ``MasterLink`` per shard (each follows its shard's HA leader):

* **Keyed calls** (put, get, exist, remove, ...): the keys are split by owner shard and sent in
  parallel, each part a request of the same type (``merge.part``); the answers are joined into
  one (``merge.merge``). A call whose keys all live on one shard (every single-key call) goes
  straight to it from the caller's thread. A shard that answers ``WrongShard`` (this link's map
  is stale) makes the link fetch the newer map and send those keys again; nothing was done for
  them, so that is safe. ``SlotMoving`` is retried by the shard's link within the deadline.
* **Calls about the whole pool**: ``remove_regex``/``remove_all`` go to every shard (counts
  added), ``list_keys`` reads a page from every shard and merges them in order, ``whoami`` asks
  one shard.
* **Calls of a segment host** (``mount``, ``ping``, ``unmount``, ``repair_done``): see
  ``host.py``: the host mounts its share of every segment with every shard and acknowledges
  each shard's fences, forgets and repairs to that shard (by the epoch in their generations).

Spares (two-round-trip puts) are not used with a sharded pool: a spare lives on one shard and
the next key may belong to another. Imports the client's ``MasterLink`` and the shard package's
pure parts; binds no sockets.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import msgspec

from kvplane.common.deadline import Deadline
from kvplane.common.errors import InvalidArgument, KVPlaneError, Timeout
from kvplane.store.client.link import MasterLink
from kvplane.store.client.timing import coarse
from kvplane.store.errors import InvalidParams, WrongShard
from kvplane.store.shard.merge import PARALLEL, merge, part
from kvplane.store.shard.session import HostSession
from kvplane.store.shard.slots import ShardInfo, ShardMap, owners, slot_of
from kvplane.store.types import MAX_LIST_KEYS, CodesRep, ListKeysRep, ListKeysReq

log = logging.getLogger(__name__)
T = TypeVar("T")
BACKOFF = (0.02, 0.25)  # seconds between two map fetches that brought nothing newer
POOL = 8  # threads that send the parts of split calls (per link)
# the pool-wide calls: every shard, answers added
SUMMED = frozenset({"remove_regex", "remove_all"})
HOST_CALLS = frozenset({"mount", "ping", "unmount", "repair_done"})  # ``session.HostSession``


class ShardedLink:
    """The client's link to every shard of a pool (see the module docstring). Thread-safe.

    Args:
        address: the address the client was given (any shard's master address).
        token: the token presented to the masters.
        timeout: default deadline of a call, seconds.
        shard_map: the map the seed shard answered with.
        seed: the link that fetched it (kept for the shard at that address).
    """

    sharded = True
    ha = False  # each shard's link follows its own leader; the host checks terms per shard
    term = 0

    def __init__(self, address: str, token: str, timeout: float, shard_map: ShardMap,
                 seed: MasterLink | None = None) -> None:
        self.address = address
        self._token, self._timeout = token, timeout
        self._lock = threading.Lock()
        self._links: dict[int, MasterLink] = {}
        self._seed = seed
        self._pool: ThreadPoolExecutor | None = None
        self.map = shard_map
        self._owner = owners(shard_map)
        self.refreshes = 0  # maps fetched because a shard redirected a call
        self.hooks: list[Callable[[ShardMap], None]] = []  # told of every newer map
        self.session = HostSession(self)
        self._adopt_seed()

    # -- shards ------------------------------------------------------------------------------
    def _adopt_seed(self) -> None:
        seed, self._seed = self._seed, None
        if seed is None:
            return
        for s in self.map.shards:
            if s.address == seed.address:
                self._links[s.id] = seed
                return
        seed.close()

    def link(self, shard_id: int, info: ShardInfo | None = None) -> MasterLink:
        """The link to shard ``shard_id`` (opened on first use; ``info``: where it is, when
        this link's map does not list it yet)."""
        got = self._links.get(shard_id)
        if got is not None and (info is None or got.address == info.address):
            return got
        info = info or self.map.shard(shard_id)
        with self._lock:
            got = self._links.get(shard_id)
            if got is None or got.address != info.address:
                got = self._links[shard_id] = MasterLink(info.address, self._token,
                                                         self._timeout)
            return got

    def shard_of(self, key: str) -> int:
        """The shard that owns ``key`` by this link's map."""
        return self._owner[slot_of(key)]

    @property
    def failovers(self) -> int:
        """Leader changes seen over every shard (a held read of before one is not trusted)."""
        return sum(link.failovers for link in list(self._links.values()))

    @property
    def leader(self) -> str:
        return ",".join(link.leader for _, link in sorted(self._links.items()))

    def saw_epoch(self, epoch: int) -> None:
        """A master answered with its epoch (per shard: ``host.py`` tells each shard's link)."""

    # -- the map -------------------------------------------------------------------------------
    def refresh(self, deadline: Deadline, ask: int | None = None, quick: bool = False) -> bool:
        """Fetch the newest map (from shard ``ask`` first, then from every shard; ``quick``:
        from ``ask`` alone); True if a newer one than this link's came."""
        version = self.map.version
        order = ([ask] if ask is not None else []) + [s for s in self.map.ids() if s != ask]
        if quick:
            order = order[:1]
        for sid in order:
            try:
                got = self.link(sid).call("shard_map", "", ShardMap, once=True,
                                          timeout=coarse(min(deadline.remaining(), 1.0)))
            except KVPlaneError as exc:
                log.debug("shard %s: no map: %s", sid, exc)
                continue
            if self.install(got):
                self.refreshes += 1
                return True
            if deadline.expired():
                break
        return self.map.version > version

    def install(self, new: ShardMap) -> bool:
        """Route by ``new`` if it is newer than this link's map; True if it was."""
        with self._lock:
            if new.version <= self.map.version:
                return False
            self.map, self._owner = new, owners(new)
        log.debug("store shard map v%s (%d shards)", new.version, len(new.shards))
        for hook in list(self.hooks):
            hook(new)
        return True

    # -- calls ---------------------------------------------------------------------------------
    def call(self, method: str, request: Any, reply_type: type[T], timeout: float | None = None,
             once: bool = False, meanwhile: Callable[[], None] | None = None) -> T:
        """Call ``method`` on the shards it concerns (see the module docstring).

        Raises:
            InvalidParams: a call a sharded pool does not serve (SSD-tier RPCs).
            KVPlaneError: as ``MasterLink.call``, from any shard the call went to.
        """
        deadline = Deadline.after(self._timeout if timeout is None else timeout)
        if method in PARALLEL:
            if method == "put_end" and not request.keys:  # spares given back: none are made
                return CodesRep([])  # type: ignore[return-value]  # T is CodesRep here
            if method == "put_end" and request.spare is not None:
                request = msgspec.structs.replace(request, spare=None)
            return self._keyed(method, request, reply_type, deadline, once, meanwhile)
        if method in SUMMED:
            got = self.each(method, lambda _sid: request, int, deadline, once)
            return sum(got.values())  # type: ignore[return-value]  # T is int for these
        if method == "list_keys":
            return self._list(request, deadline, once)  # type: ignore[return-value]  # T is ListKeysRep here
        if method == "whoami":
            return self.link(self.map.ids()[0]).call(method, request, reply_type,
                                                     timeout=deadline.remaining(), once=once)
        if method in HOST_CALLS:
            return getattr(self.session, method)(request, deadline, once)  # type: ignore[no-any-return]  # the session's answer is the reply type asked for
        raise InvalidParams(f"{method} is not served by a sharded pool")

    def call_shard(self, shard_id: int, method: str, request: Any, reply_type: type[T],
                   deadline: Deadline, once: bool = False, info: ShardInfo | None = None) -> T:
        """``method`` on shard ``shard_id`` alone, within ``deadline`` (``info``: see
        ``link``)."""
        left = deadline.remaining()
        if left <= 0:
            raise Timeout(f"store {method}: no time left to reach shard {shard_id}")
        return self.link(shard_id, info).call(method, request, reply_type, timeout=coarse(left),
                                              once=once)

    def each(self, method: str, request_of: Callable[[int], Any], reply_type: type[T],
             deadline: Deadline, once: bool = False, shards: list[int] | None = None,
             tolerant: bool = False) -> dict[int, T]:
        """``method`` on every shard (or ``shards``) in parallel; answers by shard.
        ``tolerant``: the answers of the shards that answered (a heartbeat must reach the
        live shards when one is down).

        Raises:
            KVPlaneError: the first failure (tolerant: only when no shard answered).
        """
        ids = self.map.ids() if shards is None else shards

        def one(sid: int) -> T:
            return self.call_shard(sid, method, request_of(sid), reply_type, deadline, once)
        futures = {sid: self.submit(partial(one, sid)) for sid in ids[1:]}
        got: dict[int, T | KVPlaneError] = {}
        for sid in ids:
            try:
                got[sid] = futures[sid].result() if sid in futures else one(sid)
            except KVPlaneError as exc:
                log.debug("shard %s: %s failed: %s", sid, method, exc)
                got[sid] = exc
        errors = [r for r in got.values() if isinstance(r, KVPlaneError)]
        if errors and (not tolerant or len(errors) == len(got)):
            raise errors[0]
        return {sid: r for sid, r in got.items() if not isinstance(r, KVPlaneError)}

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the link's sending threads."""
        pool = self._pool
        if pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(POOL, thread_name_prefix="kvplane-shards")
                pool = self._pool
        return pool.submit(fn)

    def _keyed(self, method: str, req: Any, typ: type[T], deadline: Deadline, once: bool,
               meanwhile: Callable[[], None] | None) -> T:
        keys = req.keys
        owner, todo = self._owner, list(range(len(keys)))
        sids = [owner[slot_of(k)] for k in keys]
        sid = sids[0] if sids else self.map.ids()[0]
        if sids.count(sid) == len(sids):  # one shard: straight there
            try:
                return self.link(sid).call(method, req, typ, timeout=coarse(deadline.remaining()),
                                           once=once, meanwhile=meanwhile)
            except WrongShard:
                self._refreshed(deadline, sid)
        done: list[tuple[list[int], Any]] = []
        pause = BACKOFF[0]
        while todo:
            groups: dict[int, list[int]] = {}
            if owner is not self._owner:  # a newer map since the keys were placed
                owner = self._owner
                sids = [owner[slot_of(k)] for k in keys]
            for i in todo:
                groups.setdefault(sids[i], []).append(i)
            got = self._parts(method, req, typ, groups, deadline, once, meanwhile)
            meanwhile = None  # run by the first attempt only
            todo, wrong = [], None
            for sid, (idx, rep) in got.items():
                if isinstance(rep, WrongShard):
                    todo += idx
                    wrong = sid
                else:
                    done.append((idx, rep))
            if todo:
                if not self._refreshed(deadline, wrong, quiet=True):
                    time.sleep(min(pause, max(0.0, deadline.remaining())))
                    pause = min(pause * 2, BACKOFF[1])
                todo.sort()
        return merge(len(keys), done)  # type: ignore[no-any-return]  # merged answers are of the parts' type

    def _refreshed(self, deadline: Deadline, sid: int | None, quiet: bool = False) -> bool:
        """A newer map after ``sid`` redirected; raises WrongShard when the deadline is over."""
        if deadline.remaining() <= 0:
            raise WrongShard(f"shard {sid} redirected and no newer shard map came in time "
                             f"(have v{self.map.version})")
        newer = self.refresh(deadline, sid)
        if not newer and not quiet:
            log.debug("shard %s redirected; map v%s is the newest found", sid, self.map.version)
        return newer

    def _parts(self, method: str, req: Any, typ: type[Any], groups: dict[int, list[int]],
               deadline: Deadline, once: bool, meanwhile: Callable[[], None] | None
               ) -> dict[int, tuple[list[int], Any]]:
        """Each group's part sent to its shard; per shard (indexes, answer or WrongShard).

        No threads: each part is sent while the shards before it answer (the next part goes
        out from the previous call's ``meanwhile``), so every shard works at once and the
        answers are read in turn. Parts go in ascending shard order: two threads never wait
        for each other's connections.
        """
        items = sorted(groups.items())
        got: dict[int, tuple[list[int], Any]] = {}

        def chain(k: int) -> None:
            sid, idx = items[k]
            rest = partial(chain, k + 1) if k + 1 < len(items) else meanwhile
            try:
                got[sid] = (idx, self.link(sid).call(
                    method, part(req, method, idx), typ, once=once, meanwhile=rest,
                    timeout=coarse(deadline.remaining())))
            except KVPlaneError as exc:  # (WrongShard: sent again by the caller)
                got[sid] = (idx, exc)
            if k + 1 < len(items) and items[k + 1][0] not in got:
                chain(k + 1)  # this call never sent its request: the rest go now
        chain(0)
        for _, rep in got.values():
            if isinstance(rep, KVPlaneError) and not isinstance(rep, WrongShard):
                raise rep
        return got

    def _list(self, req: ListKeysReq, deadline: Deadline, once: bool) -> ListKeysRep:
        """One page of keys in order, merged from every shard's page."""
        got = self.each("list_keys", lambda _sid: req, ListKeysRep, deadline, once)
        reps = list(got.values())
        bound = min((r.keys[-1] for r in reps if r.more and r.keys), default=None)
        keys = sorted({k for r in reps for k in r.keys if bound is None or k <= bound})
        cap = min(req.limit or MAX_LIST_KEYS, MAX_LIST_KEYS)
        more = any(r.more for r in reps) or len(keys) > cap
        return ListKeysRep(keys[:cap], more=more)

    def close(self) -> None:
        """Close every shard's link and the sending threads (idempotent)."""
        with self._lock:
            links, self._links = list(self._links.values()), {}
            pool, self._pool = self._pool, None
        for link in links:
            link.close()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def open_link(address: str, token: str = "", timeout: float = 5.0) -> MasterLink | ShardedLink:
    """The link for the master at ``address``: a ``ShardedLink`` when it is a shard of a
    sharded pool (it answers ``shard_map``), else a plain ``MasterLink``.

    Raises:
        KVPlaneError: the master could not be reached or refused the token.
    """
    seed = MasterLink(address, token, timeout)
    deadline = Deadline.after(timeout)
    try:
        while True:
            shard_map = seed.call("shard_map", "", ShardMap, timeout=coarse(deadline.remaining()))
            if shard_map.version or deadline.remaining() <= BACKOFF[1]:
                break
            time.sleep(BACKOFF[0])  # the pool is starting: its map comes in a moment
    except InvalidArgument as exc:  # "unknown method": one master, not a shard
        if "unknown method" not in str(exc):
            seed.close()
            raise
        return seed
    except BaseException:
        seed.close()
        raise
    return ShardedLink(address, token, timeout, shard_map, seed)
