"""The engine's batch planning: which transport serves each request, cut into slices, and run.

Owns :class:`Router`: the choice of transport per request (a transport chosen whatever the
protocol, else the protocol's, else under "auto" the first of the preference order that
reaches the target), the grouping of slices per target and transport (:class:`GroupKey`,
:class:`Group`), the failover a transport declares (``Capabilities.fallbacks``) and the run of
groups on the engine's executor. A request whose local memory is a device region goes as one
slice: a :class:`~kvplane.transfer.batch.DeviceSlice` to a transport that moves that kind of
device memory itself (``Capabilities.device_kinds``; its fallback staged), else to the picked
transport wrapped in :class:`~kvplane.transfer.staged.StagedTransport` (host staging through
the device's lane). Knows transports only through the seam and the
:class:`~kvplane.transfer.plugins.TransportSet`; never imports a transport module.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from typing import NamedTuple

from kvplane.common import metrics
from kvplane.common.deadline import Deadline
from kvplane.common.errors import InvalidArgument, KVPlaneError, Timeout, Unavailable
from kvplane.transfer.batch import DeviceSlice, Slice, Task, cut
from kvplane.transfer.failover import guarded
from kvplane.transfer.memory import MemoryTable, Region
from kvplane.transfer.plugins import TransportSet
from kvplane.transfer.seam import Route, Transport
from kvplane.transfer.segments import OpenSegment
from kvplane.transfer.staged import NO_VIEW, StagedTransport
from kvplane.transfer.staging import DeviceLanes
from kvplane.transfer.types import RegionKind, TransferStatus

GroupKey = tuple[int, str, int, bool]
"""What the slices of one group share: target handle, transport name, region (for a same-host
transport, else 0), and whether the transport was chosen under protocol "auto". A plain tuple:
one is built per request, and a NamedTuple costs several times a tuple to build."""


class Group(NamedTuple):
    """The slices one transport runs along one route, in one call; ``auto``: chosen under
    protocol "auto" (then the transport's fallbacks apply); ``device``: the local device of
    DeviceSlices the transport moves itself (its fallback then goes through staging)."""

    transport: Transport
    route: Route
    slices: list[Slice]
    auto: bool
    device: str = ""


class _Choice(NamedTuple):
    route: Route
    transport: Transport


class Router:
    """Plans and runs batches for one engine.

    Args:
        transports: the engine's loaded transports.
        memory: its memory table (local ranges are checked and viewed here).
        segment: the open segment of a handle (raises NotFound).
        protocol: the engine's protocol ("auto" or a registry name).
        slice_size: bytes per slice for transports that cut requests (``Capabilities.sliced``).
        executor: where groups run beyond the first (and whole background batches).
        lanes: the engine's device staging (None: device regions cannot be moved).
    """

    def __init__(self, transports: TransportSet, memory: MemoryTable,
                 segment: Callable[[int], OpenSegment], protocol: str, slice_size: int,
                 executor: cf.Executor, lanes: DeviceLanes | None = None) -> None:
        self.transports = transports
        self.memory = memory
        self.segment = segment
        self.protocol = protocol
        self.slice_size = slice_size
        self.executor = executor
        self.lanes = lanes

    def pick(self, transport: str | None, route: Route) -> Transport:
        """The transport for a request asking for ``transport`` (None: the engine's protocol).

        A peer's device region that the asked-for transport cannot reach (shared memory cannot
        map device memory) goes to the first transport of the "auto" order that reaches it
        (its listener over TCP, which stages it on the peer).

        Raises:
            InvalidArgument: the asked-for transport is not loaded or cannot reach the target.
            Unavailable: under "auto", no transport reaches it.
        """
        for t in self.transports.first:
            if t.can_reach(route):
                return t  # e.g. our own memory: one memcpy, whatever the protocol
        want = transport or self.protocol
        if want != "auto":
            asked = self.transports.by_name.get(want)
            if asked is not None and asked.can_reach(route):
                return asked
            if route.region.kind != RegionKind.DEVICE:  # a peer's device memory: any that reaches
                raise InvalidArgument(f"transport {want!r} cannot reach segment "
                                      f"{route.segment.name!r} for this request")
        for t in self.transports.ranked:
            if t.can_reach(route):
                return t
        raise Unavailable(f"no transport reaches segment {route.segment.name!r}")

    def plan(self, tasks: list[Task]) -> dict[GroupKey, Group]:
        """Group ``tasks`` into slices per target and transport; a task that cannot be
        planned (bad length or range, unknown handle, no transport) is failed here."""
        groups: dict[GroupKey, Group] = {}
        chosen: dict[tuple[int, int, str | None], _Choice] = {}  # per (segment, region, hint)
        auto = self.protocol == "auto"
        for task in tasks:
            req = task.req
            try:
                if req.length <= 0:
                    raise InvalidArgument(f"length must be > 0, got {req.length}")
                mine = self.memory.find(req.source, req.length)
                local = _local_view(mine, req.source, req.length)
                if mine.kind == RegionKind.DEVICE and self.lanes is None:
                    raise InvalidArgument("this engine stages no device memory")
                seg = self.segment(req.target)
                region = seg.region(req.target_offset, req.length)
                pick = chosen.get((req.target, region.addr, req.transport))
                if pick is None:
                    route = Route(seg.desc, region, seg.same_host)
                    pick = chosen[(req.target, region.addr, req.transport)] = _Choice(
                        route, self.pick(req.transport, route))
                route, t = pick
            except KVPlaneError as exc:
                status = TransferStatus.TIMEOUT if isinstance(exc, Timeout) else TransferStatus.FAILED
                task.batch.fail(task, status, str(exc))
                task.code = exc.code
                continue
            caps = t.capabilities
            chosen_auto = req.transport is None and auto
            name = t.name if not mine.device else f"{t.name}@{mine.device}"
            key = (req.target, name, region.addr if caps.same_host_only else 0, chosen_auto)
            group = groups.get(key)
            if group is None:
                group = groups[key] = self._group(t, route, chosen_auto, mine)
            slices: list[Slice]
            if group.device:  # the transport moves this device memory itself
                slices = [DeviceSlice(task, req.op, local, req.target_offset, req.length,
                                      req.source, mine.device)]
            elif mine.kind == RegionKind.DEVICE:  # one slice: the wrapper cuts it into chunks
                slices = [Slice(task, req.op, local, req.target_offset, req.length)]
            else:
                size = self.slice_size if caps.sliced else max(req.length, 1)
                slices = cut(task, local, req.target_offset, req.length, size)
            task.batch.expect(task, len(slices))
            group.slices.extend(slices)
        return groups

    def _group(self, t: Transport, route: Route, auto: bool, mine: Region) -> Group:
        """A new group for requests along ``route`` by ``t`` from local region ``mine``: for
        device memory, ``t`` wrapped in host staging (``t``'s fallback applies per chunk,
        inside the wrapper, so the group itself declares none)."""
        if mine.kind != RegionKind.DEVICE:
            return Group(t, route, [], auto)
        if _moves_device(t, mine.device):
            return Group(t, route, [], auto, mine.device)
        if self.lanes is None:
            raise InvalidArgument("this engine stages no device memory")
        fb = self.transports.fallback(t, route) if auto else None
        return Group(StagedTransport(t, fb, self.lanes, mine.device), route, [], False)

    def run(self, groups: dict[GroupKey, Group], deadline: Deadline, inline: bool) -> None:
        """Run every group, in parallel on the executor (the first on this thread when
        ``inline``); returns when all have finished."""
        if not groups:
            return
        if inline and len(groups) == 1:  # one target, one transport: no executor, no lists
            for g in groups.values():
                _slices_counter(g.transport.name).inc(len(g.slices))
                guarded(g.transport, g.route, g.slices, deadline, self._fallback(g))
            return
        items = [(g, self._fallback(g)) for g in groups.values()]
        for g, _ in items:
            _slices_counter(g.transport.name).inc(len(g.slices))
        first = 0 if inline else None
        futs = [self.executor.submit(guarded, g.transport, g.route, g.slices, deadline, fb)
                for i, (g, fb) in enumerate(items) if i != first]
        if first is not None:
            g, fb = items[first]
            guarded(g.transport, g.route, g.slices, deadline, fb)
        for f in futs:
            f.result()

    def _fallback(self, group: Group) -> Transport | None:
        """Where a group chosen under protocol "auto" fails over to (the transport's own
        ``Capabilities.fallbacks``); None for a group asked of one transport. A group of
        DeviceSlices fails over through host staging, unless the fallback moves that device
        memory itself too."""
        fb = self.transports.fallback(group.transport, group.route) if group.auto else None
        if fb is None or not group.device or _moves_device(fb, group.device):
            return fb
        return StagedTransport(fb, None, self.lanes, group.device) if self.lanes else None


_SLICES: dict[str, metrics.Counter] = {}


def _slices_counter(transport: str) -> metrics.Counter:
    """The slices counter of ``transport`` (its labelled child, looked up once)."""
    c = _SLICES.get(transport)
    if c is None:
        c = _SLICES[transport] = metrics.TRANSFER_SLICES.labels(transport)
    return c


def _moves_device(t: Transport, device: str) -> bool:
    """Whether ``t`` moves memory on ``device`` itself (``Capabilities.device_kinds``)."""
    return device.split(":", 1)[0] in t.capabilities.device_kinds


def _local_view(region: Region, addr: int, length: int) -> memoryview:
    """The view of ``[addr, addr+length)`` in local ``region``; for device memory
    :data:`~kvplane.transfer.staged.NO_VIEW` (its bytes move through staging, never a view).

    Raises:
        InvalidArgument: a file region (nothing local to copy to or from).
    """
    if region.kind == RegionKind.DEVICE:
        return NO_VIEW
    if region.view is None:
        raise InvalidArgument(f"{addr:#x} is in a {region.kind} region; it has no memory view")
    off = addr - region.addr
    return region.view[off:off + length]
