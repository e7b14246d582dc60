"""The Transport seam: what the engine asks of every way of moving bytes."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import NamedTuple

from kvplane.common.deadline import Deadline
from kvplane.transfer.batch import Slice
from kvplane.transfer.types import RegionDesc, SegmentDesc


@dataclass(frozen=True)
class Capabilities:
    """What a transport can do. ``same_host_only``: it needs the target on this host."""

    same_host_only: bool = False
    priority: int = 0  # higher wins under protocol "auto"


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


class Transport(abc.ABC):
    """Moves slices between local registered memory and one target segment.

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

    def close(self) -> None:
        """Release connections and mappings (idempotent)."""
