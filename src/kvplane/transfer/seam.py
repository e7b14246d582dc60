"""The transport seam: what the engine asks of every way of moving bytes, and what it may ask.

Owns the required plugin base (:class:`Transport`: ``can_reach``, ``run``, ``close``), the
declared properties every transport carries (:class:`Capabilities`), the optional
capabilities a transport may implement (runtime-checkable protocols: :class:`VectoredIO`,
:class:`OneItemIO`, :class:`RouteOneIO`, :class:`MappedOneIO`, :class:`ControlChannel`,
:class:`Prunable`) and the records passed
across (:class:`Route`, :class:`TransportContext`). The engine discovers the optional ones
once per transport (``kvplane.transfer.plugins.TransportSet``) and never names a transport.

Imports only the batch, job and type records; never a transport module nor the engine.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

from kvplane.common.deadline import Deadline
from kvplane.transfer.batch import Slice
from kvplane.transfer.jobs import Peer, PeerJob
from kvplane.transfer.memory import Region
from kvplane.transfer.types import OpCode, RegionDesc, SegmentDesc, TransferStatus


@dataclass(frozen=True)
class Capabilities:
    """How the engine treats a transport's requests (declared by the transport class).

    Attributes:
        same_host_only: it needs the target on this host (its groups are kept per region).
        priority: higher wins under protocol "auto".
        any_protocol: chosen before the protocol's transport wherever it reaches (this
            process's own memory: one memcpy, whatever the protocol says).
        sliced: requests are cut into ``slice_size`` slices (pipelined over a stream);
            False: one slice per request.
        via_listener: its frames are served by the target's data listener, which checks
            generations against its fence table (retired ones included) and tenant grants.
        fallbacks: transports (registry names, in order) that slices it FAILED go to under
            protocol "auto" (TENT-style failover); the first loaded one reaching the target.
        device_kinds: kinds of device ("cuda": the part of a device name before ":") whose
            local memory it moves by itself: it gets those requests as
            :class:`~kvplane.transfer.batch.DeviceSlice` (no view; ``addr`` on ``device``),
            one per request. Requests from other device memory reach it through host staging.
    """

    same_host_only: bool = False
    priority: int = 0
    any_protocol: bool = False
    sliced: bool = False
    via_listener: bool = False
    fallbacks: tuple[str, ...] = ()
    device_kinds: tuple[str, ...] = ()


class Route(NamedTuple):
    """Where one request goes: the target segment and the region holding the range."""

    segment: SegmentDesc
    region: RegionDesc
    same_host: bool


@dataclass(frozen=True)
class TransportContext:
    """What the engine hands every transport at construction."""

    host_id: str
    token: str
    slice_size: int
    streams: int
    file_root: str
    connect_timeout: float = 5.0
    retries: int = 2
    segment: str = ""  # this engine's own segment name
    grants: bool = False  # the listener moves tenants' bytes only under grants (a pool segment)


class Transport(abc.ABC):
    """Moves slices between local registered memory and one target segment (the required
    protocol every plugin implements).

    Implementations are thread-safe: ``run`` may be called from many threads at once.
    """

    name = "abstract"
    capabilities = Capabilities()

    def __init__(self, ctx: TransportContext) -> None:
        self.ctx = ctx

    @abc.abstractmethod
    def can_reach(self, route: Route) -> bool:
        """Cheap check: can this transport serve requests along ``route``? Never blocks."""

    @abc.abstractmethod
    def run(self, route: Route, slices: list[Slice], deadline: Deadline) -> None:
        """Execute ``slices`` to ``route.segment``; blocks until each slice has reported.

        Every slice must be finished through ``slice.done(status)`` by the time this returns:
        COMPLETED, FAILED (peer gone, rejected) or TIMEOUT (``deadline`` passed). Never raises
        for transfer failures; never blocks past ``deadline`` by more than one socket timeout.
        """

    def close(self) -> None:  # noqa: B027  (optional hook: most transports hold nothing)
        """Release connections and mappings (idempotent)."""


@runtime_checkable
class VectoredIO(Protocol):
    """Many items per peer with no per-slice bookkeeping (``read_many``/``write_many``)."""

    def read_scatter(self, jobs: list[PeerJob], deadline: Deadline) -> None:
        """Run READ-only jobs (one per peer); every entry ends with a status in ``job.status``:
        COMPLETED, FAILED or TIMEOUT. Never raises for transfer failures."""

    def write_gather(self, jobs: list[PeerJob], deadline: Deadline) -> None:
        """Run WRITE-only jobs (``views`` are the sources), as :meth:`read_scatter`."""


@runtime_checkable
class OneItemIO(Protocol):
    """One READ or WRITE with the least Python (``read_one``/``write_one``)."""

    def read_one(self, peer: Peer, view: memoryview, remote: int, gen: int,
                 deadline: Deadline) -> TransferStatus:
        """Read ``len(view)`` bytes at ``remote`` into ``view``: COMPLETED, FAILED or TIMEOUT."""

    def write_one(self, peer: Peer, view: memoryview, remote: int, gen: int,
                  deadline: Deadline) -> TransferStatus:
        """Write ``view`` to ``remote``: COMPLETED, FAILED or TIMEOUT."""


@runtime_checkable
class MappedOneIO(Protocol):
    """One READ or WRITE between local host memory and the route's region, which this
    transport maps into the process (``copy_one``): a same-host copy with no batch, slice or
    socket."""

    def copy_one(self, op: OpCode, route: Route, view: memoryview, remote: int, gen: int,
                 deadline: Deadline) -> TransferStatus | None:
        """Copy ``len(view)`` bytes between ``view`` and ``remote`` (inside ``route.region``):
        COMPLETED, or FAILED or TIMEOUT once bytes may have moved. None, having moved nothing,
        where this transport does not take it this way (a region it copies otherwise, an
        owner gone, a fence that refuses ``gen``): the engine then runs it as a batch of one,
        whose failover and errors are the usual ones."""


Outcome = tuple[TransferStatus, str]
"""How one request ended: its status and the error ("" when it completed)."""


@runtime_checkable
class RouteOneIO(Protocol):
    """One READ or WRITE from host memory along a route the engine resolved and cached, with
    no batch, task or slice (``TransferEngine.transfer_one``)."""

    def route_one(self, op: OpCode, route: Route, local: int, remote: int, length: int,
                  at: float) -> Outcome | None:
        """Move ``length`` bytes between the local address ``local`` (inside registered host
        memory) and ``remote`` (inside ``route.region``) before the monotonic time ``at``:
        COMPLETED, FAILED or TIMEOUT with the error, as ``run`` of that one slice would end.
        None, having moved nothing, where this transport would no longer reach ``route``
        (``can_reach``) or does not take such a request this way: the engine then plans it
        as usual. Never raises for transfer failures."""


@runtime_checkable
class ControlChannel(Protocol):
    """Requests to a peer's data listener that move no bytes: the P2P handshake, retiring
    store generations (fences) and installing tenant grants. An engine needs one."""

    def describe(self, peer: Peer, timeout: float) -> bytes:
        """The peer's encoded segment descriptor. Raises Unavailable."""

    def retire(self, peer: Peer, gens: list[int], timeout: float) -> None:
        """Have the peer's listener refuse frames of ``gens``. Raises Unavailable."""

    def grant(self, peer: Peer, blob: bytes, timeout: float) -> bytes:
        """Install packed grants at the peer's listener; one status byte per grant (0: kept).
        Raises Unavailable."""


@runtime_checkable
class RegistersMemory(Protocol):
    """Needs the engine's registered regions itself (a one-sided fabric such as NIXL/UCX
    registers them with its own agent) and publishes what peers need to reach them."""

    def on_register(self, region: Region) -> None:
        """A region was registered with the engine (raise to refuse it: the engine undoes
        the registration)."""

    def on_unregister(self, region: Region) -> None:
        """A region left the engine (never raises)."""

    def advert(self) -> bytes:
        """What peers need to reach this engine's regions over this transport (b"": not
        reachable over it); carried in the segment descriptor under the transport's name."""


@runtime_checkable
class Prunable(Protocol):
    """Holds per-peer state (mappings) that a peer's exit makes stale."""

    def prune(self) -> int:
        """Drop the state of peers whose process has exited; returns how many."""
