"""Views of the object table's rows: :class:`Row` (one object) and :class:`ObjectsView` (the
table as a mapping of key -> row, in LRU order).

A view holds only the columns and a row number; it is made on access and must not be kept
across a drop of its object (the row is reused). The services over the table (repair, the
disk tier, adoption, tasks, spares, the replica RPCs) read and write objects through it with
the names the per-object records had; the master's hot paths read the columns directly.
Pure: no I/O, no threads, no clocks. Imports only ``columns``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

from kvplane.store.master.columns import COMPLETE, HARD_PIN, NONE, Columns, OpenPut

if TYPE_CHECKING:
    from kvplane.store.types import Replica

# One memory replica of an object: (segment name, offset of its allocation, generation).
Rep = tuple[str, int, int]
_NO_DISK: Mapping[str, str] = MappingProxyType({})


class SegmentLike(Protocol):
    """What a view needs of a mounted segment (``table.Segment``)."""

    def replica(self, off: int, size: int, gen: int = 0, hdr: int = 0) -> Replica: ...


class Row:
    """One object, read and written in place (see the module docstring)."""

    __slots__ = ("_c", "row")

    def __init__(self, cols: Columns, row: int) -> None:
        self._c = cols
        self.row = row

    @property
    def key(self) -> str:
        return self._c.key(self.row)

    # -- fixed at the put --------------------------------------------------------------------
    @property
    def size(self) -> int:
        return self._c.size[self.row]

    @property
    def hdr(self) -> int:
        """Bytes of the inventory header in front of the value in every replica."""
        return self._c.hdr[self.row]

    @property
    def version(self) -> int:
        """The generation of the put that made it."""
        return self._c.version[self.row]

    @property
    def flags(self) -> int:
        """Inventory flags (hard pin)."""
        return self._c.iflags[self.row]

    @property
    def hard_pin(self) -> bool:
        return bool(self._c.flags[self.row] & HARD_PIN)

    @property
    def checksum(self) -> int:
        return self._c.checksum[self.row]

    @checksum.setter
    def checksum(self, value: int) -> None:
        self._c.checksum[self.row] = value

    @property
    def want(self) -> int:
        """Replicas asked for."""
        return self._c.want[self.row]

    @want.setter
    def want(self, value: int) -> None:
        self._c.want[self.row] = value

    @property
    def owner(self) -> str:
        """Client id of the put that made it (Mooncake's metadata.client_id)."""
        return self._c.owners[self._c.owner[self.row]]

    @owner.setter
    def owner(self, client_id: str) -> None:
        self._c.owner[self.row] = self._c.owner_id(client_id)

    # -- state ---------------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        return bool(self._c.flags[self.row] & COMPLETE)

    @property
    def lease_until(self) -> float:
        return self._c.lease[self.row]

    @lease_until.setter
    def lease_until(self, value: float) -> None:
        self._c.lease[self.row] = value

    @property
    def soft_pin_until(self) -> float:
        return self._c.pins.get(self.row, 0.0)

    @soft_pin_until.setter
    def soft_pin_until(self, value: float) -> None:
        if value:
            self._c.pins[self.row] = value
        else:
            self._c.pins.pop(self.row, None)

    @property
    def open_put(self) -> OpenPut | None:
        """The unfinished put's own fields (None once complete)."""
        return self._c.puts.get(self.row)

    @property
    def started(self) -> float:
        p = self._c.puts.get(self.row)
        return p.started if p is not None else 0.0

    @property
    def writer(self) -> str:
        p = self._c.puts.get(self.row)
        return p.writer if p is not None else ""

    @property
    def window_until(self) -> float:
        p = self._c.puts.get(self.row)
        return p.window_until if p is not None else 0.0

    @window_until.setter
    def window_until(self, value: float) -> None:
        p = self._c.puts.get(self.row)
        if p is not None:
            p.window_until = value

    @property
    def header(self) -> bytes:
        p = self._c.puts.get(self.row)
        return p.header if p is not None else b""

    @property
    def nonce(self) -> int:
        p = self._c.puts.get(self.row)
        return p.nonce if p is not None else 0

    @property
    def soft_pin_ttl(self) -> float:
        p = self._c.puts.get(self.row)
        return p.soft_pin_ttl if p is not None else 0.0

    # -- where it is ---------------------------------------------------------------------------
    @property
    def disk(self) -> Mapping[str, str]:
        """SSD copies: segment -> path (read-only; set it whole, or ``set_disk``)."""
        return self._c.disk.get(self.row, _NO_DISK)

    @disk.setter
    def disk(self, copies: Mapping[str, str]) -> None:
        if copies:
            self._c.disk[self.row] = dict(copies)
        else:
            self._c.disk.pop(self.row, None)

    def set_disk(self, segment: str, path: str | None) -> bool:
        """Add (``path``) or remove (None) the SSD copy on ``segment``; True when removing
        found one."""
        copies = self._c.disk.get(self.row)
        if path is not None:
            self._c.disk.setdefault(self.row, {})[segment] = path
            return False
        if copies is None or copies.pop(segment, None) is None:
            return False
        if not copies:
            del self._c.disk[self.row]
        return True

    @property
    def replicas(self) -> tuple[Rep, ...]:
        """Memory replicas on mounted segments: (segment, offset, generation)."""
        names = self._c.names
        return tuple((names[s], o, g) for s, o, g in self._c.replicas(self.row))

    @replicas.setter
    def replicas(self, reps: Sequence[Rep]) -> None:
        sid_of = self._c.sid_of
        self._c.set_replicas(self.row, [(sid_of[s], o, g) for s, o, g in reps])

    def first_sid(self) -> int:
        """The segment id of the first replica (-1: none); it may have gone (not live)."""
        return self._c.seg[self.row]

    def more_replicas(self) -> bool:
        """Whether it has replicas past the first (in replica rows)."""
        return self._c.more[self.row] != NONE

    def replica_count(self) -> int:
        """How many memory replicas (on mounted segments) it has."""
        c, row = self._c, self.row
        sid = c.seg[row]
        if c.more[row] == NONE:
            return 1 if sid >= 0 and c.live[sid] else 0
        return len(c.replicas(row))

    def replicas_of(self, segments: Mapping[str, SegmentLike], reps: Sequence[Rep] | None = None
                    ) -> list[Replica]:
        """The wire form of ``reps`` (default: every replica) of this object."""
        size, hdr = self.size, self.hdr
        return [segments[s].replica(o, size, g, hdr) for s, o, g in
                (self.replicas if reps is None else reps)]


class ObjectsView(Mapping[str, Row]):
    """The object table as a read-only mapping key -> :class:`Row`, least recently used
    first. Iterating it walks every object: the master's passes must not (tests and small
    admin views may)."""

    def __init__(self, cols: Columns) -> None:
        self._c = cols

    def __getitem__(self, key: str) -> Row:
        row = self._c.index.find(key)
        if row < 0:
            raise KeyError(key)
        return Row(self._c, row)

    def get(self, key: str, default: Row | None = None) -> Row | None:  # type: ignore[override]  # one signature for Mapping.get's overloads
        row = self._c.index.find(key)
        return Row(self._c, row) if row >= 0 else default

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._c.index.find(key) >= 0

    def __len__(self) -> int:
        return self._c.count

    def __iter__(self) -> Iterator[str]:
        keys = self._c.keys
        for row in list(self._c.rows()):
            key = keys[row]
            if key is not None:
                yield key.decode()
