"""ShardRole: what makes a master one shard of a sharded pool.

A :class:`ShardRole` is an extension of ``MasterServer`` (``extensions=[role]``): it holds the
shard map and this shard's id, refuses every keyed RPC whose keys this shard does not serve, and
serves the shard RPCs. Its check runs under the master's lock before each handler, so "this
shard serves slot s" and the handler's effect are one atomic step: a map change (also under the
lock) falls either before the call (refused) or after it.

Refusals (``kvplane.store.shard.slots`` for the slot states):

* ``WrongShard`` for a key of a slot another shard owns: the caller's map is stale (it asks
  this shard for the map, ``shard_map``, and goes to the owner). Never an answer about a key
  this shard does not own.
* ``SlotMoving`` (a ``Recovering``: clients retry within their deadline) for a key of a slot in
  transit: writes on the source (reads and the ends of puts already started go on until the
  source freezes the slots for the copy), everything on the target.

The shard RPCs (service or admin token only): ``shard_map`` (the map, any token),
``shard_set_map`` (install a newer map), and the slot-move steps of ``moves.py``.

Imports the master's serving layer and the shard package's pure parts; binds nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvplane.common import log as klog
from kvplane.store.errors import InvalidParams, SlotMoving, WrongShard
from kvplane.store.master.access import require_service
from kvplane.store.master.serving import Handlers, Serving
from kvplane.store.shard import move_rpc
from kvplane.store.shard import status as pool_status
from kvplane.store.shard.messages import SetMapReq
from kvplane.store.shard.peers import Peers
from kvplane.store.shard.slots import (
    IN,
    OTHER,
    OUT,
    OWN,
    ShardMap,
    SlotTable,
    check,
    slot_of,
    slot_of_internal,
)

log = logging.getLogger(__name__)

READS = frozenset({"get_replicas", "exist", "get_size", "replica_descs"})
STARTS = frozenset({"put_start", "remove", "replica_clear"})  # writes that begin something
ENDS = frozenset({"put_end", "put_revoke"})  # the end of a put already started
ONE_KEY = frozenset({"task_create"})  # ``req.key``
RECORDS = frozenset({"adopt", "disk_adopt"})  # ``req.records[i].key``: internal keys
# the slot states each kind of call is served in (else: OTHER -> WrongShard, else SlotMoving)
SERVED = {**dict.fromkeys(READS, (OWN, OUT)), **dict.fromkeys(STARTS, (OWN,)),
          **dict.fromkeys(ENDS, (OWN, OUT)), **dict.fromkeys(ONE_KEY, (OWN,)),
          **dict.fromkeys(RECORDS, (OWN, OUT))}


class ShardRole:
    """This master's part in a sharded pool (an ``Extension`` of ``MasterServer``).

    Args:
        me: this shard's id.
        shard_map: the map to start from (a newer one replaces it: ``install``).
        on_map: called (under the lock) with every map installed after the first.
        watched: a map watch (``launch.MapWatch``) will keep the map current: serve no key
            until it asked the other shards (set here, so not even the first call slips by).
    """

    def __init__(self, me: int, shard_map: ShardMap, token: str = "",
                 on_map: Callable[[ShardMap], None] | None = None,
                 watched: bool = False) -> None:
        check(shard_map)  # a shard joining a pool may not be in its map yet: it owns nothing
        self.me = me
        self.table = SlotTable(shard_map, me)
        self.frozen = bytearray(len(self.table.state))  # OUT slots whose copy began: no ends
        self.on_map = on_map
        self.block: dict[str, Any] = {}  # the ``shard`` block of ``/status`` (kept current)
        self.peers = Peers(token)  # the other shards' masters (for the pool's status)
        self._serving: Serving | None = None
        # a watched shard (``launch.MapWatch``) serves no key until its watch has asked the
        # other shards for their maps: at start, and after each new term of its own
        self.watched = watched
        self.verify = False
        self.turn = 0  # new terms seen: a watch round that began before one verifies nothing
        self._seen: object = None
        self._describe()

    @property
    def map(self) -> ShardMap:
        """The shard map this shard serves by."""
        return self.table.map

    # -- the check (under the master's lock) ----------------------------------------------------
    def check(self, method: str, request: Any) -> None:
        """Refuse ``request`` unless this shard serves every key it names (see module doc).

        Raises:
            WrongShard: a key of a slot another shard owns.
            SlotMoving: a key of a slot in transit, for a call not served meanwhile.
        """
        served = SERVED.get(method)
        if served is None:
            return
        if not self.map.version:  # a placeholder map: the pool is still starting
            raise SlotMoving("the shard map is not installed yet")
        self._unverified()
        if method in RECORDS:
            self._check_slots([slot_of_internal(r.key) for r in request.records], served, method)
        elif method in ONE_KEY:
            self._check_slots([slot_of(request.key)], served, method)
        else:
            self._check_slots([slot_of(k) for k in request.keys], served, method)

    def _unverified(self) -> None:
        """Refuse while a watched shard has not asked the others for their maps since it
        started or began a new term (its own map may be older than theirs).

        Raises:
            SlotMoving: not asked yet.
        """
        if not self.watched:
            return
        state = self._serving.state if self._serving is not None else None
        if state is not self._seen:  # a new term (HA) or the first call
            self._seen, self.verify = state, True
            self.turn += 1
        if self.verify:
            raise SlotMoving(f"shard {self.me} is checking its map with the other shards")

    def _check_slots(self, slots: list[int], served: tuple[int, ...], method: str) -> None:
        state, frozen = self.table.state, self.frozen
        for slot in slots:
            st = state[slot]
            if st in served and not (st == OUT and method in ENDS and frozen[slot]):
                continue
            if st == OTHER:
                owner = self.table.owner[slot]
                raise WrongShard(f"slot {slot} is served by shard {owner}, not {self.me} "
                                 f"(shard map v{self.map.version})")
            raise SlotMoving(f"slot {slot} is moving between shards (map v{self.map.version})")

    def verified(self, turn: int) -> None:
        """The watch asked the other shards, in a round that began at ``turn``."""
        if turn == self.turn:
            self.verify = False

    # -- the map -------------------------------------------------------------------------------
    def install(self, new: ShardMap) -> bool:
        """Serve by ``new`` from now on if it is newer (under the lock); True if installed.

        Raises:
            InvalidArgument: a malformed map, or one that no longer lists this shard while it
                still owns slots in it.
        """
        check(new)
        if new.version <= self.map.version:
            return False
        table = SlotTable(new, self.me)
        if not any(s.id == self.me for s in new.shards) and any(table.state):
            raise InvalidParams(f"shard map v{new.version} leaves out shard {self.me}")
        self.table = table
        self.frozen = bytearray(len(table.state))
        self._describe()
        klog.event("shard_map_installed", shard=self.me, version=new.version,
                   slots=sum(1 for s in table.state if s in (OWN, OUT)),
                   moving=len(new.moving))
        if self.on_map is not None:
            self.on_map(new)
        return True

    def _describe(self) -> None:
        m, state = self.map, self.table.state
        self.block.clear()
        self.block.update({
            "id": self.me, "shards": len(m.shards), "map_version": m.version,
            "slots": sum(1 for s in state if s in (OWN, OUT)),
            "moving_out": sum(1 for s in state if s == OUT),
            "moving_in": sum(1 for s in state if s == IN),
            "map": [{"id": s.id, "address": s.address, "admin": s.admin} for s in m.shards]})

    # -- RPCs ------------------------------------------------------------------------------------
    def handlers(self, serving: Serving) -> Handlers:
        """The shard RPCs, registered by the master with its own."""
        self._serving = serving
        return {"shard_map": (self._get_map, str), "shard_set_map": (self._set_map, SetMapReq),
                "shard_epoch": (self._epoch, str), **move_rpc.handlers(self, serving)}

    def status(self, doc: dict[str, Any], admin: bool, with_history: bool) -> dict[str, Any]:
        """The pool's document: this shard's ``doc`` joined with every other shard's own
        (``status.pool``; a shard that does not answer within ``STATUS_WAIT`` is listed as
        unreachable). Called outside the master's lock."""
        m = self.map
        if not m.version:
            return doc
        others = {s.id: s.address for s in m.shards if s.id != self.me and s.address}
        docs: dict[int, dict[str, Any] | None] = dict(
            self.peers.statuses(others, admin, with_history))
        docs[self.me] = doc
        return pool_status.pool(self.me, docs)

    def _epoch(self, _client_id: str) -> int:
        return self._serving.state.epoch if self._serving is not None else 0

    def _get_map(self, _client_id: str) -> ShardMap:
        self._unverified()  # (a segment host clears the records the map it gets disowns)
        return self.map

    def _set_map(self, req: SetMapReq) -> int:
        require_service("a shard map change")
        if req.expect and self._serving is not None and self._serving.state.epoch != req.expect:
            raise SlotMoving(f"shard {self.me} restarted or failed over (epoch "
                             f"{self._serving.state.epoch}, not {req.expect})")
        self.install(req.map)
        return self.map.version
