"""The TCP data protocol: fixed binary headers and exact send/receive helpers.

Request (40 bytes, little endian): magic u32, version u8, op u8, flags u16, id u64, addr u64,
length u64, gen u64. ``gen`` is the store allocation's generation (0: unfenced; see
``kvplane.transfer.fence``): the listener refuses a READ or WRITE whose generation was fenced or
belongs to another master epoch. A WRITE is followed by ``length`` payload bytes; HELLO by a ``length``-byte token.
Response (24 bytes): magic u32, status i32 (0 ok, else a kvplane error code), id u64, length
u64, followed by ``length`` bytes (READ data, a DESCRIBE descriptor, or an error message).
"""

from __future__ import annotations

import socket
import struct

from kvplane.common.errors import ProtocolError
from kvplane.common.sockets import recv_exact, recv_spin, set_io_timeout  # noqa: F401 (re-exported)

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
OPS = {OP_HELLO: "hello", OP_DESCRIBE: "describe", OP_READ: "read", OP_WRITE: "write", OP_PING: "ping"}

MAX_TOKEN = 4096
MAX_ERROR = 4096


def pack_req(op: int, rid: int, addr: int, length: int, gen: int = 0) -> bytes:
    """Encode a request header (``gen`` 0: no fencing)."""
    return REQ.pack(MAGIC, VERSION, op, 0, rid, addr, length, gen)


def pack_resp(status: int, rid: int, length: int) -> bytes:
    """Encode a response header."""
    return RESP.pack(RESP_MAGIC, status, rid, length)


def send_all(sock: socket.socket, bufs: list[bytes | memoryview]) -> None:
    """Send every buffer with ``sendmsg`` (no joining copies), handling partial sends."""
    views = [memoryview(b) for b in bufs]
    while views:
        try:
            sent = sock.sendmsg(views)
        except BlockingIOError as exc:
            raise TimeoutError("send timed out") from exc
        while sent:
            head = views[0]
            if sent >= len(head):
                sent -= len(head)
                views.pop(0)
            else:
                views[0] = head[sent:]
                sent = 0
        if views and len(views[0]) == 0:
            views.pop(0)


def check_resp_magic(magic: int) -> None:
    """Raise ProtocolError unless ``magic`` marks a response."""
    if magic != RESP_MAGIC:
        raise ProtocolError(f"bad response magic {magic:#x}")
