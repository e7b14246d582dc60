"""ClientContext: what every layer of one store client shares, and nothing that acts on it.

The configuration, the transfer engine, the master link, the staging memory, the segment
handles, the suspects and retired generations the next RPC reports, the location cache, the held
spare, the links to disk nodes and the segments this client contributes. The layers above
(``kvplane.store.client.LAYERS``) take a context, never the client: the facade
(``client.StoreClient``) builds one and hands it down.

Its two calls are the ones every layer makes: a segment's engine handle (opened once) and a
master RPC bounded by the call's deadline (with a tenant's grants installed from the answer).
Imports the lower client modules only (``timing``, ``link``, ``staging``, ``suspects``,
``location_cache``, ``spares``, ``grants``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from kvplane.common.deadline import Deadline
from kvplane.common.rpc import RpcClient
from kvplane.store.client import grants
from kvplane.store.client.link import MasterLink
from kvplane.store.client.location_cache import Locations
from kvplane.store.client.spares import Spares
from kvplane.store.client.staging import Staging
from kvplane.store.client.suspects import Retired, Suspects
from kvplane.store.client.timing import coarse
from kvplane.store.config import StoreConfig
from kvplane.store.shard.link import ShardedLink
from kvplane.store.types import Grant, SegmentInfo
from kvplane.transfer import TransferEngine

T = TypeVar("T")


class DiskLinks:
    """RPC connections to the disk endpoints of other nodes (one per endpoint)."""

    def __init__(self, token: str) -> None:
        self._token = token
        self._lock = threading.Lock()
        self._links: dict[str, RpcClient] = {}

    def get(self, endpoint: str) -> RpcClient:
        """The connection to ``endpoint``, opened on first use."""
        with self._lock:
            link = self._links.get(endpoint)
            if link is None:
                link = self._links[endpoint] = RpcClient(endpoint, self._token)
            return link

    def close(self) -> None:
        """Close every connection (idempotent)."""
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()


class ClientContext:
    """The state of one store client that its layers share (see the module docstring).

    Plain attributes, read on the hot path without a call. Thread-safe where the objects
    it holds are; ``handles`` and ``listened`` are dicts whose single operations are atomic.

    Args:
        config: the client's configuration.
        engine: its transfer engine.
        rpc: its link to the (leading) master, or to every shard of a sharded pool.
        staging: its registered staging memory.
    """

    __slots__ = ("config", "engine", "rpc", "staging", "handles", "listened", "suspects",
                 "retired", "locations", "spares", "disk_links", "lease_ttl", "corrupt_reads",
                 "largest_segment", "segments", "closed")

    def __init__(self, config: StoreConfig, engine: TransferEngine, rpc: MasterLink | ShardedLink,
                 staging: Staging) -> None:
        self.config = config
        self.engine = engine
        self.rpc = rpc
        self.staging = staging
        self.handles: dict[str, int] = {}  # segment -> engine handle
        self.listened: dict[int, bool] = {}  # segment handle -> reads go through its listener
        self.suspects = Suspects()
        self.retired = Retired()
        self.locations = Locations(config.location_cache)  # where recent keys are
        self.spares = Spares(config.spares)  # space placed one put ahead (two-hop puts)
        self.disk_links = DiskLinks(config.token)
        self.lease_ttl = config.lease_ttl  # the master's read lease, as its last lookup said
        self.corrupt_reads = 0  # replica reads whose bytes failed the checksum
        self.largest_segment = 0  # the master's last ValueTooLarge answer named it
        self.segments: list[SegmentInfo] = []  # what this client contributes (host package)
        self.closed = threading.Event()

    def segment_handle(self, segment: str, deadline: Deadline | None = None) -> int:
        """The engine's handle of ``segment``, opened once (bounded by ``deadline``)."""
        h = self.handles.get(segment)
        if h is None:
            left = self.config.timeout if deadline is None else deadline.check("segment lookup")
            h = self.engine.open_segment(segment, timeout=min(left, 5.0))
            self.handles[segment] = h
        return h

    def call(self, method: str, req: Any, typ: type[T], deadline: Deadline,
             meanwhile: Callable[[], None] | None = None) -> T:
        """A master RPC bounded by what is left of the call's deadline (``meanwhile``: see
        ``MasterLink.call``); a tenant's grants in the answer are installed before it returns."""
        rep = self.rpc.call(method, req, typ, meanwhile=meanwhile,
                            timeout=coarse(deadline.check(f"store {method}")))
        given = getattr(rep, "grants", None)
        if given:  # a tenant's: installed before any transfer there
            grants.install(self.engine, self.segment_handle, given, deadline)
        return rep

    def install_grants(self, given: list[Grant], deadline: Deadline) -> None:
        """Install a tenant's ``given`` grants at their segments (``grants.install``)."""
        grants.install(self.engine, self.segment_handle, given, deadline)


class ContextOwner(Protocol):
    """Anything that hands out a client's context (``StoreClient``): what the Mooncake extras
    (``ranges``, ``replica_ops``) are built from."""

    @property
    def context(self) -> ClientContext:
        """The owner's shared client state."""
        ...
