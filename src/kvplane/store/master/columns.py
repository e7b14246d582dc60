"""The object table's storage: one row per object in typed arrays, no Python object per object.

Pure: no I/O, no threads, no clocks. Used by the object table (``table.py``) only.

Layout (docs/store.md, "How the object table is laid out"):

* **Columns** (``array.array``, one machine value per row): size, version, checksum, read
  lease end, the first replica (segment id, offset, generation), header length, replicas
  asked for, state flags, inventory flags, owner id, and the LRU links (``nxt``/``prv``).
  Rows freed by a drop go on a free list threaded through ``nxt`` and are reused first;
  past the rows ever used, the arrays grow by a thirty-second at a time (growth writes the
  new rows, so a bigger step would hold memory no object uses).
* **Replica rows**: an object's second and later replicas, in their own columns (segment id,
  offset, generation, next, owning row), chained from the object's ``more`` column.
* **Keys**: the keys, UTF-8 ``bytes`` (16 bytes smaller than the same ``str``), by row in
  :class:`KeyList` (numpy object arrays: the cyclic collector does not walk them), and
  :class:`KeyIndex`, an open-addressing hash table of int32 rows split into shards by hash,
  so that one shard's growth rehashes a small part of the keys (a short pause) and
  never the whole table.
* **Sparse side tables** (rows that need them only): unfinished puts (:class:`OpenPut`),
  soft pins, and SSD copies.

Segments are small ids (``sid``) here; ``names`` gives a sid's name and ``live`` whether it is
mounted. A replica on a sid that is not live (its segment was unmounted and the sweep has not
reached the row yet) is not a replica any more: every reader skips it.

numpy sees the columns without copying (``view``) for scans of a whole column; such a view
must not outlive the scan (an array with a view cannot grow).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from functools import partial

import numpy as np

from kvplane.store.master import keys as keymod
from kvplane.store.master.keys import KeyIndex, KeyList

NONE = -1  # (no row, no segment)
COMPLETE = 1  # ``flags`` bits
HARD_PIN = 2
SHORT = 4  # it may hold fewer replicas than asked for (re-replication looks at it)
SHORT_LISTED = 2048  # up to this many short rows are also kept in a set (``short_rows``)
_GROW_MIN = 4096  # rows added at least when the columns grow
_GROW_SHIFT = 5  # ... and at most a 1/32 of the rows they have

# (name, typecode) of every object column; ``Columns.__init__`` makes one array each
_OBJECT_COLUMNS = (("nxt", "i"), ("prv", "i"), ("size", "q"), ("version", "q"),
                   ("checksum", "Q"), ("lease", "d"), ("seg", "h"), ("off", "q"), ("gen", "q"),
                   ("more", "i"), ("hdr", "H"), ("want", "H"), ("flags", "B"),
                   ("iflags", "B"), ("owner", "i"))
_REPLICA_COLUMNS = (("rseg", "h"), ("roff", "q"), ("rgen", "q"), ("rnext", "i"),
                    ("rrow", "i"))


@dataclass
class Census:
    """Counts over the whole table (``Columns.census``)."""

    objects: int  # complete objects
    pending: int  # unfinished puts
    replicas: int  # memory replicas of complete objects
    bytes: int  # value bytes of complete objects
    hard_pinned: int  # complete hard-pinned objects
    per_segment: dict[str, int]  # memory replicas (of any object) by mounted segment


@dataclass(slots=True)
class OpenPut:
    """What only an unfinished put needs (a side table entry, dropped when it ends)."""

    started: float
    writer: str = ""  # client id of the put
    window_until: float = 0.0  # the writer may copy into its replicas until then
    header: bytes = b""  # the inventory header the writer copies in front of the value
    nonce: int = 0  # id of the PutStart call that made it (a retry of it resumes the put)
    soft_pin_ttl: float = 0.0  # seconds of soft pin from the commit


class ShardedIntMap(MutableMapping[int, int]):
    """int -> int in 64 dicts by key: growing one rehashes 1/64 of it (a queue of a million
    entries grows without a step of tens of ms)."""

    def __init__(self) -> None:
        self._maps: list[dict[int, int]] = [{} for _ in range(64)]
        self._n = 0

    def __getitem__(self, key: int) -> int:
        return self._maps[key & 63][key]

    def __setitem__(self, key: int, value: int) -> None:
        m = self._maps[key & 63]
        self._n += key not in m
        m[key] = value

    def __delitem__(self, key: int) -> None:
        del self._maps[key & 63][key]
        self._n -= 1

    def __iter__(self) -> Iterator[int]:
        for m in self._maps:
            yield from m

    def __len__(self) -> int:
        return self._n


class Columns:
    """The rows of every object (see the module docstring). The caller (the object table)
    keeps them consistent: it owns what a row means."""

    nxt: array[int]
    prv: array[int]
    size: array[int]
    version: array[int]
    checksum: array[int]
    lease: array[float]
    seg: array[int]
    off: array[int]
    gen: array[int]
    more: array[int]
    hdr: array[int]
    want: array[int]
    flags: array[int]
    iflags: array[int]
    owner: array[int]
    rseg: array[int]
    roff: array[int]
    rgen: array[int]
    rnext: array[int]
    rrow: array[int]

    def __init__(self) -> None:
        for name, code in _OBJECT_COLUMNS + _REPLICA_COLUMNS:
            setattr(self, name, array(code))
        self.keys = KeyList()  # by row, UTF-8 (``key``: the str)
        self.index = KeyIndex(self.keys)
        self.count = 0
        self._ends = array("i", [NONE, NONE])  # the least and the most recently used row
        native = keymod.native
        self.touch: Callable[[int], None] = partial(
            native.touch, self.nxt, self.prv, self._ends) if native is not None else self._touch
        self._free = NONE  # freed rows, threaded through ``nxt``
        self._top = 0  # rows below have been used
        self._rfree = NONE  # freed replica rows, threaded through ``rnext``
        self._rtop = 0
        self.puts: dict[int, OpenPut] = {}  # unfinished puts by row
        self.pins: dict[int, float] = {}  # soft pin deadline by row
        self.disk: dict[int, dict[str, str]] = {}  # SSD copies by row: segment -> path
        self.owners: list[str] = [""]  # owner id -> client id
        self._owner_ids: dict[str, int] = {"": 0}
        self.names: list[str] = []  # sid -> segment name (kept until its sweep is over)
        self.live = bytearray()  # sid -> 1 while mounted
        self.sid_of: dict[str, int] = {}  # name -> sid of every mounted segment
        self.short = 0  # rows with the SHORT bit ...
        # ... and, while there are at most SHORT_LISTED of them, the same rows (None: more;
        # then only a scan of the column finds them, ``short_in``)
        self.short_rows: set[int] | None = set()

    # -- segments ---------------------------------------------------------------------------
    def new_sid(self, name: str) -> int:
        """A segment id for a newly mounted segment ``name`` (a free one, else a new one)."""
        for sid, alive in enumerate(self.live):
            if not alive and self.names[sid] == "":
                break
        else:
            sid = len(self.names)
            if sid > 0x7FFF:
                raise OverflowError("more than 32768 segments")
            self.names.append("")
            self.live.append(0)
        self.names[sid] = name
        self.live[sid] = 1
        self.sid_of[name] = sid
        return sid

    def retire_sid(self, name: str) -> int:
        """Segment ``name`` was unmounted: its replicas are not replicas any more (the sweep
        takes them out of their rows, then ``release_sid``). Returns its sid."""
        sid = self.sid_of.pop(name)
        self.live[sid] = 0
        return sid

    def release_sid(self, sid: int) -> None:
        """``sid`` holds no replica any more: it may be given to another segment."""
        self.live[sid] = 0
        self.names[sid] = ""

    # -- rows ---------------------------------------------------------------------------------
    def add(self, key: str) -> int:
        """A new row for ``key`` (not present), linked as the most recently used, with no
        replica (``seg`` and ``more`` -1); the caller writes every other column."""
        kb = key.encode()
        row = self._free
        if row >= 0:
            self._free = self.nxt[row]
            self.keys[row] = kb
        else:
            row = self._top
            if row == len(self.nxt):
                self._grow(max(_GROW_MIN, row >> _GROW_SHIFT))
            self._top += 1
            self.keys.append(kb)
        self.seg[row] = NONE
        self.more[row] = NONE
        self.index.add(kb, row)
        self._link(row)
        self.count += 1
        return row

    def drop(self, row: int) -> None:
        """Forget ``row`` (its key, replica rows, side entries); the row is reused later."""
        key = self.keys[row]
        assert key is not None  # a live row
        self.index.remove(key)
        self._unlink(row)
        self._free_chain(self.more[row])
        self.more[row] = NONE
        self.seg[row] = NONE
        self.unmark_short(row)
        self.flags[row] = 0  # (a free row counts as no object in ``census``)
        self.keys[row] = None
        self.puts.pop(row, None)
        self.pins.pop(row, None)
        self.disk.pop(row, None)
        self.nxt[row] = self._free
        self._free = row
        self.count -= 1

    def rename(self, row: int, key: str) -> None:
        """``row`` is the object ``key`` from now on (not present), most recently used."""
        old = self.keys[row]
        assert old is not None  # a live row
        self.index.remove(old)
        kb = self.keys[row] = key.encode()
        self.index.add(kb, row)
        self.touch(row)

    def key(self, row: int) -> str:
        """The key of live ``row``."""
        kb = self.keys[row]
        assert kb is not None  # a live row
        return kb.decode()

    def _grow(self, n: int) -> None:
        for name, _code in _OBJECT_COLUMNS:
            col: array[int] | array[float] = getattr(self, name)
            col.frombytes(bytes(n * col.itemsize))

    # -- LRU ----------------------------------------------------------------------------------
    @property
    def head(self) -> int:
        """The least recently used row (-1: none)."""
        return self._ends[0]

    @property
    def tail(self) -> int:
        """The most recently used row (-1: none)."""
        return self._ends[1]

    def _link(self, row: int) -> None:
        ends = self._ends
        tail = ends[1]
        self.prv[row] = tail
        self.nxt[row] = NONE
        if tail >= 0:
            self.nxt[tail] = row
        else:
            ends[0] = row
        ends[1] = row

    def _unlink(self, row: int) -> None:
        p, n = self.prv[row], self.nxt[row]
        if p >= 0:
            self.nxt[p] = n
        else:
            self._ends[0] = n
        if n >= 0:
            self.prv[n] = p
        else:
            self._ends[1] = p

    def _touch(self, row: int) -> None:
        """Make ``row`` the most recently used (``touch`` without the C accelerator)."""
        ends = self._ends
        tail = ends[1]
        if row == tail:
            return
        nxt, prv = self.nxt, self.prv
        p, n = prv[row], nxt[row]  # n >= 0: row is not the tail
        if p >= 0:
            nxt[p] = n
        else:
            ends[0] = n
        prv[n] = p
        prv[row] = tail
        nxt[row] = NONE
        nxt[tail] = row
        ends[1] = row

    def rows(self) -> Iterator[int]:
        """Live rows, least recently used first (do not add or drop rows meanwhile)."""
        row, nxt = self.head, self.nxt
        while row >= 0:
            yield row
            row = nxt[row]

    def rows_newest(self) -> Iterator[int]:
        """Live rows, most recently used first (do not add or drop rows meanwhile)."""
        row, prv = self.tail, self.prv
        while row >= 0:
            yield row
            row = prv[row]

    # -- replicas -----------------------------------------------------------------------------
    def replicas(self, row: int) -> list[tuple[int, int, int]]:
        """(sid, offset, generation) of every replica of ``row`` on a live segment."""
        live = self.live
        out = []
        sid = self.seg[row]
        if sid >= 0 and live[sid]:
            out.append((sid, self.off[row], self.gen[row]))
        r = self.more[row]
        while r >= 0:
            sid = self.rseg[r]
            if live[sid]:
                out.append((sid, self.roff[r], self.rgen[r]))
            r = self.rnext[r]
        return out

    def set_replicas(self, row: int, reps: list[tuple[int, int, int]]) -> None:
        """Make ``reps`` (sid, offset, generation) the replicas of ``row``."""
        if self.more[row] != NONE:
            self._free_chain(self.more[row])
            self.more[row] = NONE
        if not reps:
            self.seg[row] = NONE
            return
        self.seg[row], self.off[row], self.gen[row] = reps[0]
        prev = NONE
        for sid, off, gen in reps[1:]:
            r = self._new_replica_row(row)
            self.rseg[r], self.roff[r], self.rgen[r] = sid, off, gen
            if prev < 0:
                self.more[row] = r
            else:
                self.rnext[prev] = r
            prev = r

    def _new_replica_row(self, owner: int) -> int:
        r = self._rfree
        if r >= 0:
            self._rfree = self.rnext[r]
        else:
            r = self._rtop
            if r == len(self.rnext):
                n = max(_GROW_MIN, r >> _GROW_SHIFT)
                for name, _code in _REPLICA_COLUMNS:
                    col: array[int] = getattr(self, name)
                    col.frombytes(bytes(n * col.itemsize))
            self._rtop += 1
        self.rnext[r] = NONE
        self.rrow[r] = owner
        return r

    def _free_chain(self, r: int) -> None:
        while r >= 0:
            nxt = self.rnext[r]
            self.rrow[r] = NONE
            self.rseg[r] = NONE
            self.rnext[r] = self._rfree
            self._rfree = r
            r = nxt

    def rows_on(self, sid: int, start: int, stop: int) -> tuple[list[int], int]:
        """Rows in ``[start, stop)`` whose first replica is on ``sid``, and rows (any) owning a
        replica row in that range of the replica rows on ``sid``: (rows, end of the scan)."""
        stop = min(stop, max(self._top, self._rtop))
        seg = np.frombuffer(self.seg, np.int16, min(stop, self._top) - min(start, self._top),
                            2 * min(start, self._top))
        found = (np.flatnonzero(seg == sid) + start).tolist()
        del seg
        a, b = min(start, self._rtop), min(stop, self._rtop)
        if b > a:
            rseg = np.frombuffer(self.rseg, np.int16, b - a, 2 * a)
            rrow = np.frombuffer(self.rrow, np.int32, b - a, 4 * a)
            owners = rrow[rseg == sid]
            found += owners[owners >= 0].tolist()
            del rseg, rrow, owners
        return found, stop

    def scan_end(self) -> int:
        """One past the last row or replica row ever used (the end of a full scan)."""
        return max(self._top, self._rtop)

    # -- objects short of replicas ------------------------------------------------------------
    def mark_short(self, row: int) -> None:
        """Set ``row``'s SHORT bit (it may hold fewer replicas than asked for)."""
        if self.flags[row] & SHORT:
            return
        self.flags[row] |= SHORT
        self.short += 1
        listed = self.short_rows
        if listed is not None:
            if len(listed) < SHORT_LISTED:
                listed.add(row)
            else:  # too many to list (an unmount may mark millions): the bits only
                self.short_rows = None

    def unmark_short(self, row: int) -> None:
        """Clear ``row``'s SHORT bit."""
        if not self.flags[row] & SHORT:
            return
        self.flags[row] &= ~SHORT & 0xFF
        self.short -= 1
        if self.short_rows is not None:
            self.short_rows.discard(row)
        elif not self.short:
            self.short_rows = set()  # none left: list them again

    def short_in(self, start: int, stop: int) -> list[int]:
        """Rows in ``[start, stop)`` with the SHORT bit (a vectorised scan)."""
        a, b = min(start, self._top), min(stop, self._top)
        flags = np.frombuffer(self.flags, np.uint8, b - a, a)
        found: list[int] = (np.flatnonzero(flags & SHORT) + a).tolist()
        del flags
        return found

    def census(self) -> Census:
        """Counts over every object, from whole-column scans (no Python loop per object)."""
        n, m = self._top, self._rtop
        flags = np.frombuffer(self.flags, np.uint8, n)
        seg = np.frombuffer(self.seg, np.int16, n)
        live = np.frombuffer(bytes(self.live) + b"\0", np.uint8)  # sid -1 reads the last: 0
        complete = (flags & COMPLETE) != 0  # (any other bit may be set too)
        held = complete & (live[seg] != 0)
        rseg = np.frombuffer(self.rseg, np.int16, m)
        rrow = np.frombuffer(self.rrow, np.int32, m)
        used = rrow >= 0
        rheld = used & (live[rseg] != 0)
        rheld[rheld] = complete[rrow[rheld]]
        per_sid = np.bincount(seg[seg >= 0], minlength=len(self.live)) + \
            np.bincount(rseg[used & (rseg >= 0)], minlength=len(self.live))
        out = Census(
            objects=int(complete.sum()), pending=self.count - int(complete.sum()),
            replicas=int(held.sum()) + int(rheld.sum()),
            bytes=int(np.frombuffer(self.size, np.int64, n)[complete].sum()),
            hard_pinned=int(((flags & (COMPLETE | HARD_PIN)) == COMPLETE | HARD_PIN).sum()),
            per_segment={self.names[s]: int(per_sid[s]) for s in range(len(self.live))
                         if self.live[s]})
        del flags, seg, rseg, rrow  # (views of the columns: they must not outlive the scan)
        return out

    # -- owners ---------------------------------------------------------------------------------
    def owner_id(self, client_id: str) -> int:
        """The small id of ``client_id`` in the ``owner`` column (interned)."""
        oid = self._owner_ids.get(client_id)
        if oid is None:
            oid = self._owner_ids[client_id] = len(self.owners)
            self.owners.append(client_id)
        return oid

    def nbytes(self) -> int:
        """Bytes of the arrays, the key list and the key index (not the key strings)."""
        cols: int = sum(len(getattr(self, n)) * getattr(self, n).itemsize
                        for n, _ in _OBJECT_COLUMNS + _REPLICA_COLUMNS)
        return cols + self.keys.nbytes() + self.index.nbytes()
