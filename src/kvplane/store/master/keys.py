"""The object table's keys: :class:`KeyList` (the keys by row) and :class:`KeyIndex` (key ->
row). Pure: no I/O, no threads, no clocks. Used by the table's storage (``columns.py``) only.

``native`` is the optional C accelerator (``_table.c``): where it was built, the index's
probe and the LRU move (``Columns.touch``) run there; the Python code here and in
``columns.py`` is the fallback and reads and writes the same arrays the same way.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from functools import partial

import numpy as np

try:  # ``native``: the optional C accelerator (pyproject's ext-modules); else the Python code
    from kvplane.store.master import _table as native
except ImportError:  # pragma: no cover - depends on the build
    native = None  # type: ignore[assignment]  # not built: callers test for None

__all__ = ["NONE", "SHARDS", "KeyIndex", "KeyList", "native"]

NONE = -1
_SHARD_BITS = 10
SHARDS = 1 << _SHARD_BITS  # key index shards: one growth rehashes about 1/SHARDS of the keys
_SHARD_MASK = SHARDS - 1
_MIN_SLOTS = 8
_KEY_BITS = 16  # keys are held in numpy object arrays of 2**_KEY_BITS rows each
_KEY_MASK = (1 << _KEY_BITS) - 1


class KeyList:
    """The keys by row (UTF-8 ``bytes``, None for a free row), in numpy object arrays of
    2**16 rows each, with the interface of a list (index, assign, append, len).

    Not a list: a full collection of Python's cyclic collector visits every item of a list
    (one cache miss per key: 0.1-0.4 s at 10M keys, with every thread stopped), and numpy
    arrays are not tracked by the collector (these hold bytes and None only: no cycle can go
    through them). In chunks: growing never copies the keys held (and touches none).
    """

    def __init__(self) -> None:
        self.chunks: list[np.ndarray] = []
        self.addrs = array("Q")  # where each chunk's items are (the C accelerator reads them)
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, row: int) -> bytes | None:
        key: bytes | None = self.chunks[row >> _KEY_BITS][row & _KEY_MASK]
        return key

    def __setitem__(self, row: int, key: bytes | None) -> None:
        self.chunks[row >> _KEY_BITS][row & _KEY_MASK] = key

    def append(self, key: bytes) -> None:
        """Add ``key`` as row ``len(self)``."""
        n = self._n
        if n == len(self.chunks) << _KEY_BITS:
            chunk = np.empty(1 << _KEY_BITS, object)  # (every item None)
            self.chunks.append(chunk)
            self.addrs.append(chunk.ctypes.data)
        self.chunks[n >> _KEY_BITS][n & _KEY_MASK] = key
        self._n = n + 1

    def nbytes(self) -> int:
        """Bytes of the arrays (not of the keys)."""
        return sum(int(a.nbytes) for a in self.chunks)


class KeyIndex:
    """Key -> row: linear probing over int32 slots (-1 empty), in ``SHARDS`` shards by hash.

    The keys live in the caller's :class:`KeyList` (UTF-8 bytes by row); a slot holds only
    the row. A shard doubles when two thirds full, rehashing only its own keys; removal shifts the
    following entries back (no tombstones).
    """

    find: Callable[[str], int]  # the row of a key (str), or -1

    def __init__(self, keys: KeyList) -> None:
        self._keys = keys.chunks
        self._shards = [array("i", [NONE]) * _MIN_SLOTS for _ in range(SHARDS)]
        self._used = [0] * SHARDS
        self.find = partial(native.find, self._shards, keys.addrs) if native is not None \
            else self._find

    def _find(self, key: str) -> int:
        """The row of ``key``, or -1 (``find`` without the C accelerator)."""
        kb = key.encode()
        h = hash(kb)
        slots = self._shards[h & _SHARD_MASK]
        mask = len(slots) - 1
        i = (h >> _SHARD_BITS) & mask
        keys = self._keys
        while True:
            r = slots[i]
            if r < 0 or keys[r >> _KEY_BITS][r & _KEY_MASK] == kb:
                return r
            i = (i + 1) & mask

    def add(self, key: bytes, row: int) -> None:
        """Index ``key`` (not indexed yet) at ``row``."""
        h = hash(key)
        s = h & _SHARD_MASK
        slots = self._shards[s]
        if 3 * (self._used[s] + 1) > 2 * len(slots):
            slots = self._grow(s)
        mask = len(slots) - 1
        i = (h >> _SHARD_BITS) & mask
        while slots[i] >= 0:
            i = (i + 1) & mask
        slots[i] = row
        self._used[s] += 1

    def remove(self, key: bytes) -> None:
        """Unindex ``key`` (indexed; ``keys`` still holds it)."""
        h = hash(key)
        s = h & _SHARD_MASK
        slots = self._shards[s]
        mask = len(slots) - 1
        i = (h >> _SHARD_BITS) & mask
        keys = self._keys
        while True:
            r = slots[i]
            if keys[r >> _KEY_BITS][r & _KEY_MASK] == key:
                break
            i = (i + 1) & mask
        j = i
        while True:  # shift back every entry that may not stay past the hole at i
            j = (j + 1) & mask
            r = slots[j]
            if r < 0:
                break
            home = (hash(keys[r >> _KEY_BITS][r & _KEY_MASK]) >> _SHARD_BITS) & mask
            if (i < home <= j) if i <= j else (home > i or home <= j):
                continue
            slots[i] = r
            i = j
        slots[i] = NONE
        self._used[s] -= 1

    def _grow(self, s: int) -> array[int]:
        old = self._shards[s]
        new = array("i", [NONE]) * (2 * len(old))
        mask = len(new) - 1
        keys = self._keys
        for r in old:
            if r >= 0:
                i = (hash(keys[r >> _KEY_BITS][r & _KEY_MASK]) >> _SHARD_BITS) & mask
                while new[i] >= 0:
                    i = (i + 1) & mask
                new[i] = r
        self._shards[s] = new
        return new

    def nbytes(self) -> int:
        """Bytes of the slots."""
        return sum(len(a) * a.itemsize for a in self._shards)
