"""The SSD tier's on-disk layout: one file per object, written so a torn file is never served.

A file is an image of the object's memory allocation plus a footer::

    [inventory header: hlen bytes][value: size bytes][footer: b"KVPLEND1", u64 hlen + size]

The header is the one the master built for the put (``kvplane.store.inventory``): key, version,
size, xxh3 checksum of the value, wanted replicas, flags, and a tag keyed by the service token
over all of them. The key is stored whole (a tenant-scoped key stays tenant-scoped), so a file
re-registered after a restart names exactly the object it held.

Crash safety:

* **write**: a temporary file in ``tmp/`` (O_EXCL), written, fsync'ed, renamed over the final
  name, then the directory fsync'ed. A crash leaves either the old file, the new one, or a
  temporary that ``sweep_tmp`` deletes on the next start: never a partial file under a final
  name, on a file system that keeps rename atomic (ext4, xfs).
* **read**: every read checks the length against the header and footer, the header's tag and
  key, and the value's checksum; anything else (a file truncated or overwritten behind our back)
  raises ``Corrupt`` and is never returned. ``scan`` (at start) checks lengths, footer and tag,
  not the values: a value is checked when it is read.

Reads go through the page cache (``preadv`` straight into the destination) or, with
``direct=True``, through O_DIRECT into an aligned bounce buffer; docs/benchmarks.md measures both
(``python benchmarks/store.py --disk-only``).

Pure file I/O: imports ``kvplane.store.inventory`` and ``kvplane.store.checksum`` only.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path

from kvplane.common.errors import KVPlaneError
from kvplane.store import inventory
from kvplane.store.checksum import digest

FOOTER = struct.Struct("<8sQ")
END_MAGIC = b"KVPLEND1"
SUFFIX = ".kv"
PAGE = 4096


class Corrupt(KVPlaneError):
    """A disk file failed verification (torn, truncated, overwritten or foreign): not served."""

    code = -1301  # UNABLE_OFFLOADING: nearest of Mooncake's codes for a broken disk replica


class Foreign(Corrupt):
    """A file whose header's tag does not verify under this master's key: written under another
    service token (or damaged there). Never served; kept at start, in case the token changes
    back."""


def name_of(key: str) -> str:
    """The file name of ``key`` (a hash: keys may hold any character)."""
    return hashlib.blake2b(key.encode(), digest_size=16).hexdigest() + SUFFIX


def path_of(root: Path, key: str) -> Path:
    name = name_of(key)
    return root / name[:2] / name


def file_bytes(hlen: int, size: int) -> int:
    """Bytes a file of this object takes on disk, counted in whole 4 KiB blocks (the quota's unit)."""
    return (hlen + size + FOOTER.size + PAGE - 1) // PAGE * PAGE


def write_atomic(root: Path, key: str, header: memoryview | bytes, value: memoryview | bytes) -> Path:
    """Write one object's file crash-safely (see the module docstring); returns its path."""
    final = path_of(root, key)
    final.parent.mkdir(exist_ok=True)
    tmp = root / "tmp" / f"{final.stem}.{os.getpid()}.{os.urandom(4).hex()}.part"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        footer = FOOTER.pack(END_MAGIC, len(header) + len(value))
        _write_all(fd, [header, value, footer])
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    return final


def _write_all(fd: int, parts: list[memoryview | bytes]) -> None:
    pos = 0
    for part in parts:
        view = memoryview(part).cast("B")
        while len(view):
            n = os.pwrite(fd, view, pos)
            pos += n
            view = view[n:]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def parse_header(head: bytes, secret: bytes) -> inventory.Record:
    """The record in a header alone (``inventory.parse`` wants the value in the same buffer).

    Raises:
        Corrupt: bad magic, lengths or tag.
    """
    if len(head) < inventory.FIXED:
        raise Corrupt("header cut short")
    (magic, hlen, klen, flags, gen, version, size, csum, want, _, tag) = \
        inventory._HEAD.unpack_from(head, 0)
    if magic != inventory.MAGIC or hlen % inventory.ALIGN or klen == 0 or size <= 0 \
            or not inventory.FIXED + klen <= hlen <= min(len(head), inventory.MAX_HEADER):
        raise Corrupt("not a record header")
    kb = bytes(head[inventory.FIXED:inventory.FIXED + klen])
    if inventory._tag(secret, hlen, kb, flags, version, size, csum, want) != tag:
        raise Foreign("header tag does not verify (another cluster's token, or damaged)")
    try:
        key = kb.decode()
    except UnicodeDecodeError as exc:
        raise Corrupt("key is not UTF-8") from exc
    return inventory.Record(0, hlen, key, version, gen, size, csum, want, flags)


def read_header(path: Path, secret: bytes) -> inventory.Record:
    """The record a file holds, after checking its length, footer and tag (not its value).

    Raises:
        Corrupt: the file is not a whole, well-formed object file.
    """
    try:
        with open(path, "rb", buffering=0) as f:
            length = os.fstat(f.fileno()).st_size
            if length < inventory.FIXED + FOOTER.size:
                raise Corrupt(f"{path.name}: {length} bytes, too short")
            head = f.read(min(length, inventory.MAX_HEADER))
            f.seek(length - FOOTER.size)
            magic, body = FOOTER.unpack(f.read(FOOTER.size))
    except OSError as exc:
        raise Corrupt(f"{path.name}: {exc}") from exc
    rec = parse_header(head, secret)
    if magic != END_MAGIC or body != rec.hdr + rec.size or length != body + FOOTER.size:
        raise Corrupt(f"{path.name}: torn (length {length}, header says {rec.hdr + rec.size})")
    return rec


def read_into(path: Path, rec: inventory.Record, dest: memoryview, secret: bytes,
              direct: bool = False) -> None:
    """Read the file image ``[header][value]`` of ``rec`` into ``dest`` and verify it.

    ``dest`` must hold ``rec.hdr + rec.size`` bytes. The file must hold ``rec``'s key, version
    and size under a valid tag, and its value must match the checksum.

    Raises:
        Corrupt: the file changed, is torn, or its bytes fail the checksum.
    """
    n = rec.hdr + rec.size
    if len(dest) < n:
        raise Corrupt(f"{path.name}: destination of {len(dest)} bytes for {n}")
    try:
        if os.stat(path).st_size != n + FOOTER.size:
            raise Corrupt(f"{path.name}: torn (length differs from its header)")
        got = _read_direct(path, dest, n) if direct else _read_cached(path, dest, n)
    except OSError as exc:
        raise Corrupt(f"{path.name}: {exc}") from exc
    if got != n:
        raise Corrupt(f"{path.name}: read {got} of {n} bytes (truncated)")
    check(dest[:n], rec, secret, path.name)


def check(image: memoryview, rec: inventory.Record, secret: bytes, name: str = "") -> None:
    """Raise ``Corrupt`` unless ``image`` (``[header][value]``) holds ``rec`` intact."""
    head = parse_header(bytes(image[:rec.hdr]), secret)
    if head.key != rec.key or head.version != rec.version or head.size != rec.size:
        raise Corrupt(f"{name}: holds {head.key!r} v{head.version}, not {rec.key!r} v{rec.version}")
    if digest(image[rec.hdr:rec.hdr + rec.size]) != rec.checksum:
        raise Corrupt(f"{name}: value fails its checksum")


def _read_cached(path: Path, dest: memoryview, n: int) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        got = 0
        while got < n:
            k = os.preadv(fd, [dest[got:n]], got)
            if k == 0:
                break
            got += k
        return got
    finally:
        os.close(fd)


def _read_direct(path: Path, dest: memoryview, n: int) -> int:
    """O_DIRECT read through a page-aligned bounce buffer (falls back to the page cache where
    the file system refuses O_DIRECT)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return _read_cached(path, dest, n)
        raise
    span = (n + PAGE - 1) // PAGE * PAGE
    buf = mmap.mmap(-1, span)
    try:
        got = 0
        while got < n:
            k = os.preadv(fd, [memoryview(buf)[got:span]], got)
            if k == 0:
                break
            got += k
        got = min(got, n)
        dest[:got] = memoryview(buf)[:got]
        return got
    finally:
        buf.close()
        os.close(fd)


def scan(root: Path, secret: bytes) -> Iterator[tuple[Path, inventory.Record | Corrupt]]:
    """Every object file under ``root`` with its record, or the ``Corrupt`` (``Foreign``) it
    failed ``read_header`` with."""
    for sub in sorted(root.iterdir()):
        if not sub.is_dir() or len(sub.name) != 2:
            continue
        for path in sorted(sub.glob("*" + SUFFIX)):
            try:
                yield path, read_header(path, secret)
            except Corrupt as exc:
                yield path, exc


def sweep_tmp(root: Path) -> int:
    """Delete temporaries a crash left behind; returns how many."""
    tmp = root / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    n = 0
    for part in tmp.glob("*.part"):
        part.unlink(missing_ok=True)
        n += 1
    return n
