"""The SSD tier's files and local store: crash-safe layout, verification on read, quota."""

import os

import numpy as np
import pytest

from kvplane.store import inventory
from kvplane.store.checksum import digest
from kvplane.store.disk import layout
from kvplane.store.disk.store import DiskStore

SECRET = inventory.secret_of("tok")


def image_of(key, value, version=7, secret=SECRET):
    head = inventory.pack(secret, key, 99, version, len(value), digest(value))
    rec = layout.parse_header(head, secret)
    return rec, memoryview(bytearray(head + value))


def test_write_read_roundtrip_and_header_scan(tmp_path):
    rec, image = image_of("tenant-a/k1", os.urandom(10_000))
    (tmp_path / "tmp").mkdir()
    path = layout.write_atomic(tmp_path, rec.key, image[:rec.hdr], image[rec.hdr:])
    assert path == layout.path_of(tmp_path, "tenant-a/k1")
    got = layout.read_header(path, SECRET)
    assert (got.key, got.version, got.size, got.checksum) == (rec.key, 7, 10_000, rec.checksum)
    for direct in (False, True):
        dest = bytearray(rec.hdr + rec.size)
        layout.read_into(path, rec, memoryview(dest), SECRET, direct=direct)
        assert dest == image.tobytes()
    assert [r.key for _, r in layout.scan(tmp_path, SECRET)] == ["tenant-a/k1"]
    assert list((tmp_path / "tmp").iterdir()) == []  # the temporary was renamed away


@pytest.mark.parametrize("cut", [1, 100, 5000])
def test_a_truncated_file_is_detected_by_scan_and_by_read(tmp_path, cut):
    rec, image = image_of("k", os.urandom(8192))
    (tmp_path / "tmp").mkdir()
    path = layout.write_atomic(tmp_path, rec.key, image[:rec.hdr], image[rec.hdr:])
    os.truncate(path, path.stat().st_size - cut)
    with pytest.raises(layout.Corrupt):
        layout.read_header(path, SECRET)
    dest = bytearray(rec.hdr + rec.size)
    with pytest.raises(layout.Corrupt):
        layout.read_into(path, rec, memoryview(dest), SECRET)
    assert [type(r) for _, r in layout.scan(tmp_path, SECRET)] == [layout.Corrupt]


def test_a_flipped_value_byte_fails_the_checksum(tmp_path):
    rec, image = image_of("k", os.urandom(8192))
    (tmp_path / "tmp").mkdir()
    path = layout.write_atomic(tmp_path, rec.key, image[:rec.hdr], image[rec.hdr:])
    with open(path, "r+b") as f:
        f.seek(rec.hdr + 4000)
        b = f.read(1)
        f.seek(rec.hdr + 4000)
        f.write(bytes([b[0] ^ 0xFF]))
    layout.read_header(path, SECRET)  # the header alone still looks whole
    with pytest.raises(layout.Corrupt, match="checksum"):
        layout.read_into(path, rec, memoryview(bytearray(rec.hdr + rec.size)), SECRET)


def test_a_file_written_under_another_token_does_not_verify(tmp_path):
    other = inventory.secret_of("other")
    rec, image = image_of("k", b"x" * 100, secret=other)
    (tmp_path / "tmp").mkdir()
    path = layout.write_atomic(tmp_path, rec.key, image[:rec.hdr], image[rec.hdr:])
    with pytest.raises(layout.Foreign, match="tag"):
        layout.read_header(path, SECRET)
    store = DiskStore(tmp_path, 8 << 20, SECRET)  # kept and counted, never indexed or served
    assert store.foreign == 1 and store.records() == [] and path.exists() and store.used > 0
    store.open(other)  # the master's key changed back: it is served again
    assert [r.key for r, _ in store.records()] == ["k"] and store.foreign == 0


def test_a_file_with_another_objects_header_is_not_served(tmp_path):
    rec_a, image_a = image_of("a", b"A" * 100)
    rec_b, _ = image_of("b", b"A" * 100)
    (tmp_path / "tmp").mkdir()
    path = layout.write_atomic(tmp_path, "b", image_a[:rec_a.hdr], image_a[rec_a.hdr:])
    with pytest.raises(layout.Corrupt):
        layout.read_into(path, rec_b, memoryview(bytearray(rec_b.hdr + rec_b.size)), SECRET)


def du(root):
    return sum(layout.file_bytes(0, p.stat().st_size - layout.FOOTER.size)
               for p in root.rglob("*.kv"))


def test_the_quota_holds_and_lru_files_go_first(tmp_path):
    quota = 1 << 20
    store = DiskStore(tmp_path, quota, SECRET)
    values = {f"k{i}": os.urandom(50_000) for i in range(60)}  # ~3 MiB into 1 MiB
    for i, (key, value) in enumerate(values.items()):
        rec, image = image_of(key, value, version=i + 1)
        if i == 5:
            store.entry("k0", 1)  # k0 was read: it is not the least recently used any more
        assert store.put(rec, image) is not None
        assert store.used <= quota * store.high and du(tmp_path) <= quota
    assert store.entry("k59", 60) is not None and store.entry("k0", 1) is None
    lost = dict(store.take_lost())
    assert "k1" in lost and "k59" not in lost and store.evicted == len(lost)
    assert store.usage()["files"] == len(list(tmp_path.rglob("*.kv")))


def test_an_object_larger_than_the_quota_is_refused(tmp_path):
    store = DiskStore(tmp_path, 64 << 10, SECRET)
    rec, image = image_of("big", os.urandom(100 << 10))
    assert store.put(rec, image) is None and du(tmp_path) == 0


def test_a_restart_finds_the_files_again_and_deletes_broken_ones(tmp_path):
    store = DiskStore(tmp_path, 8 << 20, SECRET)
    for i in range(5):
        rec, image = image_of(f"k{i}", np.full(4096, i, np.uint8).tobytes(), version=i + 1)
        store.put(rec, image)
    store.note_epoch(11)
    store.note_epoch(12)
    broken = layout.path_of(tmp_path, "k3")
    os.truncate(broken, 100)
    (tmp_path / "tmp" / "crash.part").write_bytes(b"half")
    again = DiskStore(tmp_path, 8 << 20, SECRET)
    assert sorted(r.key for r, _ in again.records()) == ["k0", "k1", "k2", "k4"]
    assert again.history == [11, 12] and again.corrupt == 1
    assert not broken.exists() and list((tmp_path / "tmp").glob("*.part")) == []
    e = again.entry("k2", 3)
    dest = bytearray(e.rec.hdr + e.rec.size)
    again.read_into(e, memoryview(dest))
    assert dest[e.rec.hdr:] == bytes([2]) * 4096


def test_a_file_that_fails_on_read_is_deleted_and_reported_lost(tmp_path):
    store = DiskStore(tmp_path, 8 << 20, SECRET)
    rec, image = image_of("k", os.urandom(4096))
    path = store.put(rec, image)
    os.truncate(path, 10)
    e = store.entry("k", 7)
    with pytest.raises(layout.Corrupt):
        store.read_into(e, memoryview(bytearray(rec.hdr + rec.size)))
    assert store.take_lost() == [("k", 7)] and store.entry("k", 7) is None
    assert not os.path.exists(path) and store.used == 0
