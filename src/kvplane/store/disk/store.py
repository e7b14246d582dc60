"""DiskStore: one node's SSD tier directory: its index, quota, watermarks and LRU.

Owns the files under ``root`` (``layout``). The index maps key -> the record of the one file
held for it, least recently used first. Quota: the bytes of all files, in whole 4 KiB blocks
(``layout.file_bytes``), never exceed ``quota``: a write first reserves its bytes; when that
would pass the high watermark (0.90 of the quota, Mooncake's default) the least recently used
files are deleted down to the low watermark (0.80), and a write larger than the quota is
refused. Deleted and corrupt files are queued in ``lost`` for the master.

The epochs of the masters this node mounted with are kept in ``root/epochs`` (oldest first):
after a restart they order the versions of records written under past masters.

Thread-safe (one lock around the index; file I/O outside it). Imports ``layout`` only.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from kvplane.common.errors import InvalidArgument
from kvplane.store import inventory
from kvplane.store.disk import layout

log = logging.getLogger(__name__)
HISTORY = 64


@dataclass
class Entry:
    rec: inventory.Record
    path: Path
    nbytes: int


class DiskStore:
    """See the module docstring."""

    def __init__(self, root: str | Path, quota: int, secret: bytes | None, high: float = 0.90,
                 low: float = 0.80, direct: bool = False) -> None:
        if quota <= 0 or not 0 < low <= high <= 1:
            raise InvalidArgument("disk quota must be > 0 and 0 < low <= high <= 1")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.quota, self.high, self.low = quota, high, low
        self.secret = b""
        self.direct = direct
        self._lock = threading.Lock()
        self._index: OrderedDict[str, Entry] = OrderedDict()
        self.used = 0  # bytes of indexed files plus reservations
        self.lost: list[tuple[str, int]] = []  # (key, version) gone from disk, to report
        self.corrupt = 0
        self.foreign = 0  # files kept but not served: tagged under another key
        self.evicted = 0
        self.opened = False
        self.history: list[int] = self._load_history()
        layout.sweep_tmp(self.root)
        if secret is not None:
            self.open(secret)

    # -- start -------------------------------------------------------------------------------
    def open(self, secret: bytes) -> None:
        """Index the files under the master's tag key ``secret`` (again if it changed)."""
        if self.opened and secret == self.secret:
            return
        with self._lock:
            self.secret, self.opened = secret, True
            self._index.clear()
            self.used = self.foreign = 0
            for path, rec in layout.scan(self.root, secret):
                self._take(path, rec)
            doomed = self._shrink_locked(0)  # a smaller quota than last time
        self._delete(doomed)

    def _take(self, path: Path, rec: inventory.Record | layout.Corrupt) -> None:
        if isinstance(rec, layout.Foreign):  # kept (counted in the quota), never served
            log.warning("disk tier: %s is tagged under another key; not served", path.name)
            self.foreign += 1
            self.used += layout.file_bytes(0, max(0, path.stat().st_size - layout.FOOTER.size))
            return
        if isinstance(rec, layout.Corrupt) or layout.path_of(self.root, rec.key) != path:
            log.warning("disk tier: deleting unusable file %s", path.name)
            path.unlink(missing_ok=True)
            self.corrupt += 1
            return
        n = layout.file_bytes(rec.hdr, rec.size)
        self._index[rec.key] = Entry(rec, path, n)
        self.used += n

    def _load_history(self) -> list[int]:
        try:
            data = json.loads((self.root / "epochs").read_text())
            return [int(e) for e in data][-HISTORY:]
        except (OSError, ValueError, TypeError):
            return []

    def note_epoch(self, epoch: int) -> None:
        """This node mounted with a master of ``epoch`` (persisted, crash-safely)."""
        with self._lock:
            if self.history and self.history[-1] == epoch:
                return
            self.history = (self.history + [epoch])[-HISTORY:]
            data = json.dumps(self.history).encode()
        tmp = self.root / "tmp" / f"epochs.{os.urandom(4).hex()}"
        tmp.write_bytes(data)
        os.replace(tmp, self.root / "epochs")

    def records(self) -> list[tuple[inventory.Record, str]]:
        with self._lock:
            return [(e.rec, str(e.path)) for e in self._index.values()]

    # -- writes --------------------------------------------------------------------------------
    def put(self, rec: inventory.Record, image: memoryview) -> str | None:
        """Store ``image`` (``[header][value]`` of ``rec``, already verified); returns the path,
        or None when it cannot fit in the quota."""
        n = layout.file_bytes(rec.hdr, rec.size)
        if n > self.quota * self.high:
            return None
        doomed = self._reserve(rec.key, n)
        self._delete(doomed)
        try:
            path = layout.write_atomic(self.root, rec.key, image[:rec.hdr], image[rec.hdr:])
        except OSError as exc:
            log.warning("disk tier: writing %s failed: %s", rec.key, exc)
            with self._lock:
                self.used -= n
            return None
        with self._lock:
            old = self._index.pop(rec.key, None)
            if old is not None:
                self.used -= old.nbytes
                if old.rec.version != rec.version:
                    self.lost.append((rec.key, old.rec.version))
            self._index[rec.key] = Entry(rec, path, n)
        return str(path)

    def _reserve(self, key: str, n: int) -> list[Entry]:
        """Count ``n`` bytes in, choosing LRU victims so the quota holds. Under the lock."""
        with self._lock:
            self.used += n
            return self._shrink_locked(n, skip=key)

    def _shrink(self, n: int) -> None:
        with self._lock:
            doomed = self._shrink_locked(n)
        self._delete(doomed)

    def _shrink_locked(self, n: int, skip: str = "") -> list[Entry]:
        if self.used <= self.quota * self.high:
            return []
        doomed = []
        target = self.quota * self.low
        for key in list(self._index):
            if self.used <= target:
                break
            if key == skip:
                continue
            e = self._index.pop(key)
            self.used -= e.nbytes
            self.lost.append((key, e.rec.version))
            doomed.append(e)
        self.evicted += len(doomed)
        return doomed

    def _delete(self, entries: list[Entry]) -> None:
        for e in entries:
            try:
                e.path.unlink()
            except FileNotFoundError:
                pass

    def remove(self, key: str, version: int) -> bool:
        """Delete the file of ``key`` if it holds ``version``."""
        with self._lock:
            e = self._index.get(key)
            if e is None or e.rec.version != version:
                return False
            del self._index[key]
            self.used -= e.nbytes
        self._delete([e])
        return True

    # -- reads ---------------------------------------------------------------------------------
    def entry(self, key: str, version: int) -> Entry | None:
        with self._lock:
            e = self._index.get(key)
            if e is None or e.rec.version != version:
                return None
            self._index.move_to_end(key)
            return e

    def read_into(self, e: Entry, dest: memoryview) -> None:
        """Read and verify ``e``'s file image into ``dest``.

        Raises:
            layout.Corrupt: the file failed verification; it is deleted and reported lost.
        """
        try:
            layout.read_into(e.path, e.rec, dest, self.secret, self.direct)
        except layout.Corrupt:
            self.corrupt += 1
            with self._lock:
                if self._index.get(e.rec.key) is e:
                    del self._index[e.rec.key]
                    self.used -= e.nbytes
                    self.lost.append((e.rec.key, e.rec.version))
            self._delete([e])
            raise

    def take_lost(self) -> list[tuple[str, int]]:
        with self._lock:
            out, self.lost = self.lost, []
        return out

    def usage(self) -> dict[str, int]:
        with self._lock:
            return {"used": self.used, "quota": self.quota, "files": len(self._index),
                    "evicted": self.evicted, "corrupt": self.corrupt, "foreign": self.foreign}
