"""Peers: a shard's links to the other shards' masters (for the pool's status document).

Each peer is reached through a ``MasterLink`` (so an HA shard's leader is followed); the calls
go out in parallel and each waits at most ``STATUS_WAIT`` seconds. Binds nothing; runs its
calls on a small thread pool.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvplane.common.errors import KVPlaneError
from kvplane.store.client.link import MasterLink
from kvplane.store.shard.messages import StatusReq

log = logging.getLogger(__name__)
STATUS_WAIT = 2.0  # seconds a shard waits for another's status document


class Peers:
    """Links to other shards, by address (opened on first use). Thread-safe.

    Args:
        token: the token presented to them (the service token: they are the same pool).
    """

    def __init__(self, token: str) -> None:
        self._token = token
        self._lock = threading.Lock()
        self._links: dict[str, MasterLink] = {}
        self._pool: ThreadPoolExecutor | None = None

    def link(self, address: str) -> MasterLink:
        """The link to the master at ``address``."""
        with self._lock:
            got = self._links.get(address)
            if got is None:
                got = self._links[address] = MasterLink(address, self._token, STATUS_WAIT)
            return got

    def statuses(self, shards: dict[int, str], admin: bool,
                 with_history: bool) -> dict[int, dict[str, Any] | None]:
        """Each shard's own status document (None: it did not answer in time)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(8, thread_name_prefix="kvplane-shard-peers")
            pool = self._pool
        req = StatusReq(admin, with_history)
        futures = {sid: pool.submit(self.link(addr).call, "shard_status", req, dict[str, Any],
                                    STATUS_WAIT, True) for sid, addr in shards.items()}
        out: dict[int, dict[str, Any] | None] = {}
        for sid, fut in futures.items():
            try:
                out[sid] = fut.result()
            except KVPlaneError as exc:
                log.debug("shard %s: no status: %s", sid, exc)
                out[sid] = None
        return out

    def close(self) -> None:
        """Close every link and the pool (idempotent)."""
        with self._lock:
            links, self._links = list(self._links.values()), {}
            pool, self._pool = self._pool, None
        for link in links:
            link.close()
        if pool is not None:
            pool.shutdown(wait=False)
