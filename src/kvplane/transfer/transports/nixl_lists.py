"""NIXL's prepared descriptor lists for the nixl transport, cached and released with what
they describe.

A request built from two fresh descriptor lists (``get_xfer_descs`` + ``initialize_xfer``)
makes NIXL check and resolve every descriptor against the registrations again on each call.
A *prepared* list (``prep_xfer_dlist``) is resolved once; a request then names its
descriptors by index (``make_prepped_xfer``). Here a list is one registered region cut into
blocks of one size (NIXL's compressed ``(address, len, device, stride, count)`` form: one row,
whatever the count), so a move of ``n`` bytes at a multiple of ``n`` from its region's start
is block ``offset // n`` of that region's list for ``n``.

:class:`PreppedLists` keeps them per side: the local side per (region, block size), the remote
side per (peer agent, peer region, block size); at most ``limit`` of each, least recently used
first out. A list is released when its region is unregistered (:meth:`drop_region`) or its
peer's agent is removed or loaded again (:meth:`drop_peer`: a list prepared against a peer's
old metadata names keys the peer no longer has), and never while a request made from it is
being built or run (``users``); such a list goes once its last user lets go.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

LOCAL = "NIXL_INIT_AGENT"  # prep_xfer_dlist's name for this agent's own (local) side
Key = tuple[str, int, int]  # (peer agent or LOCAL, region address, block size)
Spec = tuple[str, int, int, int, str, int]  # (agent, base, length, block, mem type, device)


class Prepped:
    """One prepared list: a region of ``count`` blocks of ``block`` bytes from ``base``."""

    __slots__ = ("handle", "base", "block", "count", "users", "dead")

    def __init__(self, handle: Any, base: int, block: int, count: int) -> None:
        self.handle, self.base, self.block, self.count = handle, base, block, count
        self.users = 0
        self.dead = False


class PreppedLists:
    """Prepared descriptor lists of one NIXL agent (see the module docstring). Thread-safe.

    Args:
        agent: the ``nixl_agent``.
        limit: lists kept per side (local, remote) before the least recently used goes.
    """

    def __init__(self, agent: Any, limit: int = 64) -> None:
        self._agent = agent
        self._limit = limit
        self._lock = threading.Lock()
        self._lists: dict[bool, OrderedDict[Key, Prepped]] = {True: OrderedDict(),
                                                              False: OrderedDict()}
        self.prepared = 0  # lists prepared so far (a counter for tests and benchmarks)
        self.broken = False  # NIXL refused a compressed list: every request goes unprepped

    def acquire_pair(self, local: Spec, remote: Spec) -> tuple[Prepped, Prepped] | None:
        """The lists of ``local`` and ``remote`` (each ``(agent, base, length, block, mem,
        dev)``: blocks of ``block`` bytes over ``[base, base+length)`` on ``agent``'s side,
        :data:`LOCAL` for ours), prepared now where not cached; both held (give them back
        with :meth:`release`). None, holding nothing, when NIXL cannot prepare one."""
        with self._lock:
            made = self.prepared
            lp = self._get(local)
            rp = self._get(remote) if lp is not None else None
            if lp is not None and rp is not None:
                lp.users += 1
                rp.users += 1
            if made == self.prepared:  # both were cached (the usual case): nothing to evict
                return (lp, rp) if lp is not None and rp is not None else None
            evicted = self._evict(self._lists[True]) + self._evict(self._lists[False])
        self._free(evicted)
        return (lp, rp) if lp is not None and rp is not None else None

    def _get(self, spec: Spec) -> Prepped | None:
        """The cached or newly prepared list of ``spec`` (under the lock)."""
        agent, base, length, block, mem, dev = spec
        key = (agent, base, block)
        side = self._lists[agent == LOCAL]
        p = side.get(key)
        if p is not None:
            side.move_to_end(key)
            return p
        if self.broken:
            return None
        count = length // block
        try:
            row = np.array([(base, block, dev, block, count)], dtype=np.uint64)
            handle = self._agent.prep_xfer_dlist(agent, row, mem)
        except Exception as exc:  # an older NIXL without compressed lists, or a refusal
            log.debug("NIXL prep_xfer_dlist refused %s %#x/%d: %s", agent, base, block, exc)
            if isinstance(exc, (TypeError, ValueError)):
                self.broken = True
            return None
        p = side[key] = Prepped(handle, base, block, count)
        self.prepared += 1
        return p

    def release(self, held: tuple[Prepped, ...]) -> None:
        """The user of ``held`` is done with them (a dropped list is freed with its last
        user)."""
        with self._lock:
            gone = []
            for p in held:
                p.users -= 1
                if p.dead and p.users == 0:
                    gone.append(p)
        self._free(gone)

    def drop_region(self, base: int) -> None:
        """Release the local lists over our region at ``base`` (it is being unregistered)."""
        self._drop(True, lambda k: k[1] == base)

    def drop_peer(self, agent: str) -> None:
        """Release the lists prepared against ``agent`` (its metadata is being removed)."""
        self._drop(False, lambda k: k[0] == agent)

    def held(self) -> list[Key]:
        """The keys of the lists held now, local ones first (for tests)."""
        with self._lock:
            return [*self._lists[True], *self._lists[False]]

    def close(self) -> None:
        """Release every list (the agent is going)."""
        self._drop(True, lambda k: True)
        self._drop(False, lambda k: True)

    def _drop(self, local: bool, match: Callable[[Key], bool]) -> None:
        side = self._lists[local]
        with self._lock:
            gone = []
            for key in [k for k in side if match(k)]:
                p = side.pop(key)
                p.dead = True
                if p.users == 0:
                    gone.append(p)
        self._free(gone)

    def _evict(self, side: OrderedDict[Key, Prepped]) -> list[Prepped]:
        gone = []
        while len(side) > self._limit:
            _, p = side.popitem(last=False)
            p.dead = True
            if p.users == 0:
                gone.append(p)
        return gone

    def _free(self, gone: list[Prepped]) -> None:
        for p in gone:
            try:
                self._agent.release_dlist_handle(p.handle)
            except Exception as exc:  # the agent is going anyway
                log.debug("NIXL release_dlist_handle: %s", exc)
