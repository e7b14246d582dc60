"""Starting the master of one shard: a ``MasterServer`` with a ``ShardRole``.

``start(me, shard_map, ...)`` builds the master of shard ``me`` serving by ``shard_map``; its
``/status`` gains a ``shard`` block (id, map version, slots, the shards' addresses), which is
what ``kvplane status`` follows to read every shard. A map of version 0 is a placeholder (the
shards' ports are not known yet): keyed calls are answered ``SlotMoving`` (retry) until a
real map is installed (``addressed``). Binds what ``MasterServer`` binds.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from kvplane.common.rpc import current_principal
from kvplane.store.master.access import require_service
from kvplane.store.master.server import MasterServer
from kvplane.store.shard.messages import StatusReq
from kvplane.store.shard.role import ShardRole
from kvplane.store.shard.slots import ShardInfo, ShardMap, even


@dataclass
class Shard:
    """A running shard: its master and its role."""

    master: MasterServer
    role: ShardRole

    @property
    def address(self) -> str:
        return f"{self.master.host}:{self.master.port}"

    def install(self, shard_map: ShardMap) -> bool:
        """Serve by ``shard_map`` if it is newer (``ShardRole.install``, under the lock)."""
        with self.master.lock:
            return self.role.install(shard_map)

    def close(self) -> None:
        """Stop the master (idempotent)."""
        self.master.close()
        self.role.peers.close()

    def __enter__(self) -> Shard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start(me: int, shard_map: ShardMap, watched: bool = False, **master_kw: Any) -> Shard:
    """The master of shard ``me`` serving by ``shard_map`` (keywords: ``MasterServer``'s;
    ``watched``: see ``ShardRole``)."""
    role = ShardRole(me, shard_map, token=master_kw.get("token", ""), watched=watched)
    srv = MasterServer(**master_kw, extensions=[role], lone_epoch=partial(lone_epoch, me))
    srv.extras["shard"] = role.block

    def own_status(req: StatusReq) -> dict[str, Any]:  # outside the lock: status() takes it
        require_service("a shard's status")
        return srv.status(req.admin and current_principal().admin, req.history, extend=False)
    srv.rpc.add("shard_status", own_status, StatusReq)
    return Shard(srv, role)


def lone_epoch(me: int) -> int:
    """A random epoch (23 bits, never 0) whose low 6 bits are shard ``me``'s id: two shards
    never share one, so a segment's fence tells their generations apart."""
    return (secrets.randbits(17) | 1) << 6 | me


def placeholder(n: int) -> ShardMap:
    """A version-0 map of ``n`` shards at no address yet (``start`` them, then ``addressed``)."""
    return even([ShardInfo(i, "") for i in range(n)], version=0)


def addressed(shards: list[Shard], host: str = "127.0.0.1", version: int = 1) -> ShardMap:
    """The even map of ``shards`` (shard i = shards[i]) at the addresses they bound."""
    return even([ShardInfo(i, f"{host}:{s.master.port}",
                           f"{host}:{s.master.http.port}" if s.master.http is not None else "")
                 for i, s in enumerate(shards)], version)


@contextlib.contextmanager
def local_pool(n: int, **master_kw: Any) -> Iterator[list[Shard]]:
    """``n`` shards in this process on free ports, serving by their even map (version 1);
    closed on exit (keywords: ``MasterServer``'s)."""
    shards: list[Shard] = []
    try:
        for i in range(n):
            shards.append(start(i, placeholder(n), **master_kw))
        shard_map = addressed(shards)
        for s in shards:
            s.install(shard_map)
        yield shards
    finally:
        for s in shards:
            s.close()
