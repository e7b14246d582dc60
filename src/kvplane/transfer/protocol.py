"""The TCP data protocol: fixed binary headers and exact send/receive helpers.

Request (40 bytes, little endian): magic u32, version u8, op u8, flags u16, id u64, addr u64,
length u64, gen u64. ``gen`` is the store allocation's generation (0: unfenced; see
``kvplane.transfer.fence``): the listener refuses a READ or WRITE whose generation was fenced or
belongs to another master epoch. A WRITE is followed by ``length`` payload bytes; HELLO by a
``length``-byte token.
Response (24 bytes): magic u32, status i32 (0 ok, else a kvplane error code), id u64, length
u64, followed by ``length`` bytes (READ data, a DESCRIBE descriptor, or an error message).

READV reads up to ``MAX_READV`` slices in one round trip: the request's ``addr`` is the entry
count N and ``length`` is ``N * 24``; the header is followed by N entries (addr u64, length u64,
gen u64, each checked and fenced like a READ). The response's ``length`` is the payload total;
it is followed by N status codes (i32; 0 ok, else the error code of that entry, whose bytes are
then absent) and the payloads of the entries that succeeded, in order.

WRITEV writes up to ``MAX_READV`` entries in one frame: ``addr`` is the entry count N and
``length`` is ``N * 24`` plus the payload total; the header is followed by N entries (as READV's,
each checked and fenced like a WRITE) and then the payloads, in order. The response's ``length``
is ``N * 4``: N status codes follow (0 written, else the error code of that entry, whose payload
was received and dropped).

RETIRE refuses reads and writes of up to ``MAX_RETIRE`` allocation generations from then on
(``Fence.retire``): ``addr`` is the count N and ``length`` is ``N * 8``, followed by N u64
generations. The response (``length`` 0) comes once they are refused.

GRANT installs up to ``MAX_GRANTS`` grants (``kvplane.transfer.grants``: 56 bytes each) for the
tenant the connection authenticated as: ``addr`` is the count N and ``length`` is ``N * 56``,
followed by the N grants. The response's ``length`` is ``N``: one status byte per grant follows
(0 kept, else why not: ``grants.BAD_MAC``, ``EXPIRED``, ``NO_SEGMENT``). A connection that
authenticated with a tenant's token has every READ, WRITE, READV/WRITEV entry and RETIRE
generation checked against its tenant's grants (no grant: ``Unauthorized``, nothing moved); on
the service token's connections GRANT is answered and ignored. Old peers never send it: the
header and every other frame are unchanged.
"""

from __future__ import annotations

import socket
import struct
import time

from kvplane.common.errors import ProtocolError, Unavailable
from kvplane.common.sockets import ran_out
from kvplane.common.sockets import recv_exact as recv_exact  # re-exported: the wire helpers
from kvplane.common.sockets import recv_spin as recv_spin
from kvplane.common.sockets import set_io_timeout as set_io_timeout

MAGIC = 0x4C50564B  # "KVPL"
RESP_MAGIC = 0x5250564B  # "KVPR"
VERSION = 2  # 2: the request header carries the allocation generation

REQ = struct.Struct("<IBBHQQQQ")
RESP = struct.Struct("<IiQQ")

OP_HELLO = 1
OP_DESCRIBE = 2
OP_READ = 3
OP_WRITE = 4
OP_PING = 5
OP_READV = 6
OP_WRITEV = 7
OP_RETIRE = 8
OP_GRANT = 9
OP_LOCAL = 10  # "your same-host Unix socket?": a msgpack kvplane.common.local.LocalInfo
OPS = {OP_HELLO: "hello", OP_DESCRIBE: "describe", OP_READ: "read", OP_WRITE: "write", OP_PING: "ping",
       OP_READV: "readv", OP_WRITEV: "writev", OP_RETIRE: "retire", OP_GRANT: "grant",
       OP_LOCAL: "local"}
READV_ENTRY = struct.Struct("<QQQ")  # addr, length, gen (READV and WRITEV)
MAX_READV = 256  # entries per READV or WRITEV frame (the iovecs stay far below IOV_MAX)
RETIRE_ENTRY = struct.Struct("<Q")  # a generation (RETIRE)
MAX_RETIRE = 4096  # generations per RETIRE frame

MAX_TOKEN = 4096
MAX_ERROR = 4096


def pack_req(op: int, rid: int, addr: int, length: int, gen: int = 0) -> bytes:
    """Encode a request header (``gen`` 0: no fencing)."""
    return REQ.pack(MAGIC, VERSION, op, 0, rid, addr, length, gen)


def pack_resp(status: int, rid: int, length: int) -> bytes:
    """Encode a response header."""
    return RESP.pack(RESP_MAGIC, status, rid, length)


def send_all(sock: socket.socket, bufs: list[bytes | memoryview]) -> None:
    """Send every buffer with ``sendmsg`` (no joining copies), handling partial sends; a peer
    that stops reading costs one kernel timeout in all (``sockets.ran_out``)."""
    since = time.monotonic()
    sent = _sendmsg(sock, bufs)
    if sent == sum(map(len, bufs)):  # the usual case: all of it at once
        return
    views = [memoryview(b) for b in bufs]
    while True:
        if ran_out(sock, socket.SO_SNDTIMEO, since):
            raise TimeoutError("send timed out")
        while sent:  # drop what went
            head = views[0]
            if sent >= len(head):
                sent -= len(head)
                views.pop(0)
            else:
                views[0] = head[sent:]
                sent = 0
        while views and len(views[0]) == 0:
            views.pop(0)
        if not views:
            return
        sent = _sendmsg(sock, views)


def _sendmsg(sock: socket.socket, bufs: list[bytes | memoryview] | list[memoryview]) -> int:
    try:
        return sock.sendmsg(bufs)
    except BlockingIOError as exc:
        raise TimeoutError("send timed out") from exc


def recv_scatter(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every view in order from ``sock`` (``recvmsg_into``: one call for many buffers).

    Raises:
        Unavailable: the peer closed the connection.
        TimeoutError: the kernel timeout expired with bytes still missing.
    """
    views = [v for v in views if len(v)]
    first = 0
    since, short = time.monotonic(), False
    try:
        while first < len(views):
            if short and ran_out(sock, socket.SO_RCVTIMEO, since):
                raise TimeoutError("receive timed out")
            batch = views[first:first + 512]
            n = sock.recvmsg_into(batch, 0, socket.MSG_WAITALL)[0]
            if n == 0:
                raise Unavailable("connection closed by peer")
            short = n < sum(map(len, batch))  # a timeout or a signal (or a peer that closed)
            while n:
                head = views[first]
                if n >= len(head):
                    n -= len(head)
                    first += 1
                else:
                    views[first] = head[n:]
                    n = 0
    except BlockingIOError as exc:
        raise TimeoutError("receive timed out") from exc


def check_resp_magic(magic: int) -> None:
    """Raise ProtocolError unless ``magic`` marks a response."""
    if magic != RESP_MAGIC:
        raise ProtocolError(f"bad response magic {magic:#x}")
