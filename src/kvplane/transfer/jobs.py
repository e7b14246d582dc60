"""Typed records that cross the engine/transport seam: peers, items, vectored jobs.

Owns :class:`Peer` (where a listener is), :class:`Item` (one READ or WRITE of
``read_many``/``write_many``, a five-int record), :class:`PeerJob` (many items to one peer,
run by a transport with the vectored capability) and :class:`Span` (their local buffers when
they share one view). Imports only ``kvplane.transfer.types``: the engine builds these and
transports run them, so neither side owns them.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Iterator
from typing import NamedTuple

from kvplane.transfer.types import TransferStatus


class Peer(NamedTuple):
    """A data listener's address (a plain ``(host, port)`` tuple compares equal)."""

    host: str
    port: int


class Item(NamedTuple):
    """One item of ``TransferEngine.read_many``/``write_many``/``read_one``/``write_one``.

    Any five-int tuple in this order is accepted where an ``Item`` is (callers build tuples
    on their hot paths); the record names the fields.

    Attributes:
        handle: the segment handle (``TransferEngine.open_segment``).
        local: the local address (inside registered memory).
        remote: the remote address (inside a region the peer published).
        length: bytes.
        gen: the store allocation's generation (0: none).
    """

    handle: int
    local: int
    remote: int
    length: int
    gen: int = 0


ItemLike = tuple[int, int, int, int, int]  # an Item, or the plain tuple of its fields


class Span:
    """The local buffers of entries that all lie in one memory view: entry ``i`` is
    ``base[offs[i]:offs[i] + lens[i]]``, sliced only when asked for (a batch of small entries
    then costs no view per entry)."""

    __slots__ = ("base", "offs", "lens")

    def __init__(self, base: memoryview, offs: list[int], lens: list[int]) -> None:
        self.base, self.offs, self.lens = base, offs, lens

    def __getitem__(self, i: int) -> memoryview:
        o = self.offs[i]
        return self.base[o:o + self.lens[i]]

    def __len__(self) -> int:
        return len(self.offs)

    def each(self, ids: list[int]) -> Iterator[memoryview]:
        """The views of entries ``ids``, one by one."""
        return map(self.__getitem__, ids)

    def runs(self, ids: list[int]) -> list[memoryview]:
        """The bytes of entries ``ids`` in order: one view when they follow each other in
        the buffer, else one per entry."""
        a, b = ids[0], ids[-1] + 1
        offs, lens = self.offs, self.lens
        if b - a == len(ids) and offs[a + 1:b] == list(map(operator.add, offs[a:b - 1],
                                                            lens[a:b - 1])):
            return [self.base[offs[a]:offs[b - 1] + lens[b - 1]]]
        return [self[i] for i in ids]


Views = list[memoryview] | Span  # where a job's entries land (READ) or come from (WRITE)


def runs(views: Views, ids: list[int]) -> list[memoryview]:
    """The buffers of entries ``ids`` in order, as few as ``views`` allows."""
    return views.runs(ids) if isinstance(views, Span) else [views[i] for i in ids]


class PeerJob:
    """Many READs from one peer or WRITEs to it, run by a vectored transport
    (``VectoredIO.read_scatter``/``write_gather``).

    ``remote``/``lengths``/``gens`` describe the entries, ``views`` are where READs land or
    where WRITEs come from (a list, or a :class:`Span` when they share one buffer);
    ``status`` and ``errors`` hold each entry's outcome once run (None: not finished; reset
    when the job starts, so entries may be appended until then).
    """

    __slots__ = ("peer", "remote", "lengths", "gens", "views", "status", "errors")

    def __init__(self, peer: tuple[str, int], remote: list[int], lengths: list[int],
                 gens: list[int], views: Views) -> None:
        self.peer, self.remote, self.lengths, self.gens, self.views = peer, remote, lengths, gens, views
        self.status: list[TransferStatus | None] = [None] * len(remote)
        self.errors: list[str] = [""] * len(remote)

    def table(self, ids: list[int]) -> bytes:
        """The READV/WRITEV rows (remote, length, gen; little-endian u64) of entries ``ids``."""
        a, b = ids[0], ids[-1] + 1
        if b - a == len(ids):  # a run of consecutive entries (every first attempt): sliced
            rows = [0] * (3 * len(ids))
            rows[0::3], rows[1::3], rows[2::3] = self.remote[a:b], self.lengths[a:b], self.gens[a:b]
        else:
            rows = [x for i in ids for x in (self.remote[i], self.lengths[i], self.gens[i])]
        return struct.pack(f"<{len(rows)}Q", *rows)

    def reset(self) -> None:
        """Mark every entry unfinished (a transport calls this when the job starts)."""
        self.status, self.errors = [None] * len(self.remote), [""] * len(self.remote)

    def pending(self) -> list[int]:
        """The indexes of the entries not finished yet."""
        return [i for i, st in enumerate(self.status) if st is None]

    def finish_pending(self, status: TransferStatus, error: str) -> None:
        """End every unfinished entry with ``status`` and ``error``."""
        for i in self.pending():
            self.status[i], self.errors[i] = status, error
