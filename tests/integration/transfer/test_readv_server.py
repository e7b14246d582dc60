"""The data listener's READV: per-entry checks and fences, one answer, hostile frames refused."""

from __future__ import annotations

import os
import random
import socket
import struct

import pytest

from kvplane.common.errors import AddressNotRegistered, Fenced, InvalidArgument
from kvplane.transfer import protocol
from kvplane.transfer.fence import EPOCH_SHIFT
from kvplane.transfer.memory import MemoryTable, Region
from kvplane.transfer.server import DataServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(20)]
BASE = 0x100000


@pytest.fixture
def server():
    mem = MemoryTable()
    data = bytearray(bytes(range(256)) * 16)  # 4 KiB
    mem.add(Region(BASE, len(data), memoryview(data)))
    srv = DataServer(mem, lambda: b"{}")
    srv.fence.set_epoch(1)
    yield srv, data
    srv.close()


def connect(srv: DataServer) -> socket.socket:
    sock = socket.create_connection((srv.host, srv.port), timeout=5)
    sock.settimeout(5)
    return sock


def recv_n(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "connection closed"
        out += chunk
    return bytes(out)


def readv(sock: socket.socket, entries: list[tuple[int, int, int]], rid: int = 7) -> None:
    table = b"".join(protocol.READV_ENTRY.pack(*e) for e in entries)
    sock.sendall(protocol.pack_req(protocol.OP_READV, rid, len(entries), len(table)) + table)


def test_each_entry_is_checked_and_fenced_on_its_own(server):
    srv, data = server
    good, fenced = 1 << EPOCH_SHIFT | 5, 1 << EPOCH_SHIFT | 6
    srv.fence.install([fenced])
    entries = [(BASE + 10, 100, good), (BASE + 4000, 200, good), (BASE, 50, fenced),
               (BASE + 300, 8, 2 << EPOCH_SHIFT | 1), (BASE + 1000, 30, 0)]
    with connect(srv) as sock:
        readv(sock, entries)
        magic, status, rid, length = protocol.RESP.unpack(recv_n(sock, protocol.RESP.size))
        assert (magic, status, rid, length) == (protocol.RESP_MAGIC, 0, 7, 130)
        codes = struct.unpack("<5i", recv_n(sock, 20))
        assert codes == (0, AddressNotRegistered.code, Fenced.code, Fenced.code, 0)
        assert recv_n(sock, 130) == bytes(data[10:110]) + bytes(data[1000:1030])
        readv(sock, [(BASE, 4, 0), (BASE + 4, 4, 0)], rid=8)  # the connection still serves
        assert protocol.RESP.unpack(recv_n(sock, protocol.RESP.size))[1:] == (0, 8, 8)
        assert recv_n(sock, 8 + 8)[8:] == bytes(data[:8])


@pytest.mark.parametrize("op,count,length", [
    (protocol.OP_READV, 0, 0), (protocol.OP_READV, protocol.MAX_READV + 1, 24 * (protocol.MAX_READV + 1)),
    (protocol.OP_READV, 2, 24 * 3),
    (protocol.OP_RETIRE, 0, 0), (protocol.OP_RETIRE, protocol.MAX_RETIRE + 1, 8 * (protocol.MAX_RETIRE + 1)),
    (protocol.OP_RETIRE, 2, 8 * 3)])
def test_a_malformed_readv_or_retire_closes_the_connection(server, op, count, length):
    srv, _ = server
    before = srv.rejected
    with connect(srv) as sock:
        sock.sendall(protocol.pack_req(op, 1, count, length))
        assert sock.recv(64) == b""  # closed without an answer
    assert srv.rejected == before + 1


def test_a_readv_over_the_frame_limit_closes_the_connection(server):
    srv, _ = server
    srv.max_frame = 64
    with connect(srv) as sock:
        readv(sock, [(BASE, 40, 0), (BASE + 40, 40, 0)])  # each fits, the total does not
        assert sock.recv(64) == b""


def writev(sock: socket.socket, entries: list[tuple[int, int, int]], payloads: list[bytes],
           rid: int = 9, length: int | None = None) -> None:
    table = b"".join(protocol.READV_ENTRY.pack(*e) for e in entries)
    body = table + b"".join(payloads)
    sock.sendall(protocol.pack_req(protocol.OP_WRITEV, rid, len(entries),
                                   len(body) if length is None else length) + body)


def test_writev_checks_and_fences_each_entry_and_drops_refused_payloads(server):
    srv, data = server
    before = bytes(data)
    good, fenced = 1 << EPOCH_SHIFT | 5, 1 << EPOCH_SHIFT | 6
    srv.fence.install([fenced])
    entries = [(BASE + 10, 4, good), (BASE + 4094, 8, good), (BASE + 100, 4, fenced),
               (BASE + 200, 4, 2 << EPOCH_SHIFT | 1), (BASE + 300, 3, 0)]
    payloads = [b"AAAA", b"B" * 8, b"CCCC", b"DDDD", b"EEE"]
    with connect(srv) as sock:
        writev(sock, entries, payloads)
        magic, status, rid, length = protocol.RESP.unpack(recv_n(sock, protocol.RESP.size))
        assert (magic, status, rid, length) == (protocol.RESP_MAGIC, 0, 9, 20)
        codes = struct.unpack("<5i", recv_n(sock, 20))
        assert codes == (0, AddressNotRegistered.code, Fenced.code, Fenced.code, 0)
        want = bytearray(before)
        want[10:14], want[300:303] = b"AAAA", b"EEE"
        assert bytes(data) == bytes(want)  # nothing of the refused entries landed
        readv(sock, [(BASE + 10, 4, 0)], rid=10)  # the stream is still in step
        assert protocol.RESP.unpack(recv_n(sock, protocol.RESP.size))[1:] == (0, 10, 4)
        assert recv_n(sock, 4 + 4)[4:] == b"AAAA"
    assert srv.fence.writing_outside() == 0  # every admitted write was ended


@pytest.mark.parametrize("count,delta", [(0, 0), (protocol.MAX_READV + 1, 0), (2, 1), (2, -1)])
def test_a_malformed_writev_closes_the_connection(server, count, delta):
    srv, data = server
    before, rejected = bytes(data), srv.rejected
    entries = [(BASE + 8 * k, 8, 0) for k in range(count)]
    body_len = 24 * count + 8 * count + delta  # delta: payloads that do not add up
    with connect(srv) as sock:
        writev(sock, entries, [b"Z" * 8] * count, length=body_len)
        try:  # closed without an answer (a reset when request bytes were left unread)
            assert sock.recv(64) == b""
        except ConnectionResetError:
            pass
    assert srv.rejected == rejected + 1 and bytes(data) == before


def test_a_refused_writev_payload_larger_than_the_drain_buffer_keeps_the_stream_in_step(server):
    srv, data = server
    big = 200 << 10  # past the region, and over the listener's 64 KiB drain buffer
    want = bytearray(data)
    want[20:24] = b"GOOD"
    with connect(srv) as sock:
        writev(sock, [(BASE, big, 0), (BASE + 20, 4, 0)], [b"X" * big, b"GOOD"])
        assert protocol.RESP.unpack(recv_n(sock, protocol.RESP.size))[1:] == (0, 9, 8)
        assert struct.unpack("<2i", recv_n(sock, 8)) == (AddressNotRegistered.code, 0)
        assert data == want  # the good entry landed, nothing of the refused one did


def test_one_readv_serves_entries_from_a_file_and_from_memory_alternately(server, tmp_path):
    """Entries that switch between a file region and memory regions each get their own bytes
    (the listener keeps the previous entry's region: a switch must look the next one up)."""
    srv, data = server
    content = bytes(range(251)) * 20  # 5020 bytes, a pattern unlike the memory's
    path = tmp_path / "region.bin"
    path.write_bytes(content)
    fd = os.open(path, os.O_RDONLY)
    fbase = 0x900000
    other = bytearray(b"\xab" * 512)
    srv.memory.add(Region(fbase, len(content), None, kind="file", path=str(path), fd=fd))
    srv.memory.add(Region(0x500000, len(other), memoryview(other)))
    try:
        entries = [(fbase + 7, 100, 0), (BASE + 20, 40, 0), (fbase + 4000, 1000, 0),
                   (fbase + 5000, 40, 0), (0x500000 + 10, 16, 0), (BASE, 8, 0)]
        want = (content[7:107] + bytes(data[20:60]) + content[4000:5000] +
                bytes(other[10:26]) + bytes(data[:8]))
        with connect(srv) as sock:
            readv(sock, entries)
            status, rid, length = protocol.RESP.unpack(recv_n(sock, protocol.RESP.size))[1:]
            assert (status, rid) == (0, 7)
            codes = struct.unpack("<6i", recv_n(sock, 24))
            assert codes == (0, 0, 0, AddressNotRegistered.code, 0, 0)  # 5000+40 > 5020
            assert length == len(want)
            assert recv_n(sock, length) == want
    finally:
        os.close(fd)


def test_a_readv_inside_one_region_returns_every_entry_in_order(server):
    """All entries admitted and in one memory region (the listener slices them a list at a
    time): any order, overlaps and empty entries included, each gets its own bytes."""
    srv, data = server
    rng = random.Random(5)
    entries = [(BASE + off, n, 0) for off, n in
               ((rng.randrange(0, 4000), rng.randrange(0, 96)) for _ in range(60))]
    entries += [(BASE + 4090, 6, 0), (BASE, 0, 0), (BASE + 10, 100, 0)]
    want = b"".join(bytes(data[a - BASE:a - BASE + n]) for a, n, _ in entries)
    with connect(srv) as sock:
        readv(sock, entries, rid=9)
        status, rid, length = protocol.RESP.unpack(recv_n(sock, protocol.RESP.size))[1:]
        assert (status, rid, length) == (0, 9, len(want))
        assert struct.unpack(f"<{len(entries)}i", recv_n(sock, 4 * len(entries))) == \
            (0,) * len(entries)
        assert recv_n(sock, length) == want


def retire(sock: socket.socket, gens: list[int], rid: int = 9) -> None:
    body = b"".join(protocol.RETIRE_ENTRY.pack(g) for g in gens)
    sock.sendall(protocol.pack_req(protocol.OP_RETIRE, rid, len(gens), len(body)) + body)


def test_a_retired_generation_is_refused_from_the_answer_on(server):
    """RETIRE (held reads: an upsert or forced remove has the old place refused): once the
    listener answered it, READs and READVs of those generations fail; others still serve."""
    srv, data = server
    old, other = 1 << EPOCH_SHIFT | 11, 1 << EPOCH_SHIFT | 12
    with connect(srv) as sock:
        readv(sock, [(BASE, 16, old)], rid=1)
        assert protocol.RESP.unpack(recv_n(sock, protocol.RESP.size))[1:] == (0, 1, 16)
        assert recv_n(sock, 4 + 16)[4:] == bytes(data[:16])
        retire(sock, [old], rid=2)
        assert protocol.RESP.unpack(recv_n(sock, protocol.RESP.size)) == (protocol.RESP_MAGIC, 0, 2, 0)
        readv(sock, [(BASE, 16, old), (BASE + 16, 16, other)], rid=3)
        assert protocol.RESP.unpack(recv_n(sock, protocol.RESP.size))[1:] == (0, 3, 16)
        assert struct.unpack("<2i", recv_n(sock, 8)) == (Fenced.code, 0)
        assert recv_n(sock, 16) == bytes(data[16:32])
    assert srv.fence.fenced(old) is False  # retired, not fenced: the master's fences stay apart


def test_readv_and_writev_entries_on_device_memory_are_refused_one_by_one(server):
    """A device region has no view: its READV/WRITEV entries get InvalidArgument, the others
    are served, and the connection stays in sync (READ/WRITE frames are staged instead)."""
    srv, data = server
    dev = 0x7D00_0000_0000_0000
    srv.memory.add(Region(dev, 4096, None, kind="dev", device="standin:0"))
    with connect(srv) as sock:
        readv(sock, [(dev + 8, 16, 0), (BASE + 20, 4, 0)])
        assert protocol.RESP.unpack(recv_n(sock, protocol.RESP.size))[1:] == (0, 7, 4)
        assert struct.unpack("<2i", recv_n(sock, 8)) == (InvalidArgument.code, 0)
        assert recv_n(sock, 4) == bytes(data[20:24])
        table = protocol.READV_ENTRY.pack(dev, 3, 0) + protocol.READV_ENTRY.pack(BASE, 3, 0)
        sock.sendall(protocol.pack_req(protocol.OP_WRITEV, 9, 2, len(table) + 6) + table
                     + b"abcxyz")
        assert protocol.RESP.unpack(recv_n(sock, protocol.RESP.size))[1:] == (0, 9, 8)
        assert struct.unpack("<2i", recv_n(sock, 8)) == (InvalidArgument.code, 0)
        assert bytes(data[:3]) == b"xyz"
