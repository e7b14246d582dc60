"""Issue 28, finding 2: tenant isolation on the data plane.

A master and a segment run as real processes with two tenants. Tenant B opens the segment's
data port with its own token and aims raw READ, WRITE, READV, WRITEV and RETIRE frames at
tenant A's true addresses and generations: with no grant, with forged grants, and with B's own
valid grants (for B's addresses). Every one is refused before a byte moves: B receives none of
A's bytes, and A's values read back intact. Malformed GRANT frames close only that connection.
Both tenants' store clients keep working (B's through its grants), over TCP only.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import struct

import pytest

from kvplane.common.errors import Unauthorized
from kvplane.store import StoreClient
from kvplane.store.types import KeysReq, ResultsRep
from kvplane.transfer import protocol
from tests.support.store_procs import spawn_master, spawn_segment

pytestmark = [pytest.mark.fault, pytest.mark.timeout(120)]
SVC = "service-token-0123456789"
TOK = {"a": "tenant-a-token-0123456789", "b": "tenant-b-token-0123456789"}
UNAUTHORIZED = Unauthorized.code
GRANT = struct.Struct("<QQQQB7x16s")  # gen, base, span, until ms, mode, MAC (transfer.grants)
N, SIZE = 16, 64 << 10


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.json"
    path.write_text(json.dumps({"tenants": TOK}))
    path.chmod(0o600)
    with spawn_master("--token", SVC, "--tenants", str(path)) as m:
        addr = m.info["master"]
        with spawn_segment(addr, "32MiB", "--token", SVC, "--tenants", str(path)) as seg:
            yield addr, seg


class Raw:
    """A hand-made data connection: every byte it receives is kept (``got``)."""

    def __init__(self, endpoint: str, token: str) -> None:
        host, port = endpoint.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.got = bytearray()
        self.rid = 0
        status, body = self.call(protocol.OP_HELLO, 0, 0, token.encode())
        assert status == 0, body

    def recv(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("closed by the segment")
            out += chunk
        self.got += out
        return bytes(out)

    def call(self, op: int, addr: int, gen: int, payload: bytes = b"") -> tuple[int, bytes]:
        """One frame (``length``: the payload's); (status, response body)."""
        self.rid += 1
        self.sock.sendall(protocol.REQ.pack(protocol.MAGIC, protocol.VERSION, op, 0, self.rid,
                                            addr, len(payload), gen) + payload)
        magic, status, rid, length = protocol.RESP.unpack(self.recv(protocol.RESP.size))
        assert magic == protocol.RESP_MAGIC and rid == self.rid
        return status, self.recv(length)

    def read(self, addr: int, n: int, gen: int) -> tuple[int, bytes]:
        self.rid += 1
        self.sock.sendall(protocol.pack_req(protocol.OP_READ, self.rid, addr, n, gen))
        _, status, _, length = protocol.RESP.unpack(self.recv(protocol.RESP.size))
        return status, self.recv(length)

    def readv(self, table: bytes, count: int) -> tuple[int, int, tuple[int, ...]]:
        """A READV; (status, payload total, per-entry codes); the payloads are kept in ``got``."""
        self.rid += 1
        self.sock.sendall(protocol.pack_req(protocol.OP_READV, self.rid, count, len(table)) + table)
        _, status, _, total = protocol.RESP.unpack(self.recv(protocol.RESP.size))
        if status:
            return status, 0, (self.recv(total),)
        codes = struct.unpack(f"<{count}i", self.recv(4 * count))
        self.recv(total)
        return status, total, codes

    def close(self) -> None:
        self.sock.close()


def _replicas(client: StoreClient, keys: list[str]) -> ResultsRep:
    return client.rpc.call("get_replicas", KeysReq(client.config.client_id, keys), ResultsRep)


def test_a_tenant_cannot_touch_another_tenants_bytes_at_a_segment(pool):
    addr, seg = pool
    with StoreClient(master=addr, token=TOK["a"], checksum=True, timeout=10) as a, \
            StoreClient(master=addr, token=TOK["b"], checksum=True, timeout=10) as b:
        values = {f"secret-{i}": os.urandom(SIZE) for i in range(N)}
        sums = {k: hashlib.sha256(v).digest() for k, v in values.items()}
        for k, v in values.items():
            a.put(k, v)
        mine = {f"own-{i}": os.urandom(SIZE) for i in range(4)}
        for k, v in mine.items():
            b.put(k, v)
        theirs = [r.replicas[0] for r in _replicas(a, list(values)).results]
        own_rep = _replicas(b, list(mine))  # B's own lookup: B's grants (when the master gives any)
        own = [r.replicas[0] for r in own_rep.results]
        endpoint = theirs[0].endpoint

        raw = Raw(endpoint, TOK["b"])
        refused = []
        # 1. no grant at all: READ, WRITE, READV, WRITEV, RETIRE of A's true addresses
        for r in theirs:
            status, body = raw.read(r.addr, r.size, r.gen)
            refused.append(status == UNAUTHORIZED and len(body) < 200)
        for r in theirs[:4]:
            status, _ = raw.call(protocol.OP_WRITE, r.addr, r.gen, b"\xee" * r.size)
            refused.append(status == UNAUTHORIZED)
        table = b"".join(protocol.READV_ENTRY.pack(r.addr, r.size, r.gen) for r in theirs)
        status, total, codes = raw.readv(table, len(theirs))
        refused.append(status == 0 and total == 0 and all(c == UNAUTHORIZED for c in codes))
        wtable = b"".join(protocol.READV_ENTRY.pack(r.addr, r.size, r.gen) for r in theirs[:4])
        status, body = raw.call(protocol.OP_WRITEV, 4, 0, wtable + b"\xdd" * (4 * SIZE))
        refused.append(status == 0 and struct.unpack("<4i", body) == (UNAUTHORIZED,) * 4)
        status, _ = raw.call(protocol.OP_RETIRE, 1, 0, struct.pack("<Q", theirs[0].gen))
        refused.append(status == UNAUTHORIZED)
        _assert_no_leak(values, bytes(raw.got))
        _assert_intact(a, values, sums)
        assert all(refused), [i for i, ok in enumerate(refused) if not ok]

        # 2. forged grants for A's allocations (zero MAC, random MAC, B's MAC on A's fields)
        op_grant = protocol.OP_GRANT
        b_grants = [blob for _, blob in (getattr(own_rep, "grants", None) or [])]
        forged = [GRANT.pack(r.gen, r.addr, r.size, 2 ** 62, 7, bytes(16)) for r in theirs[:2]]
        forged += [GRANT.pack(r.gen, r.addr, r.size, 2 ** 62, 7, os.urandom(16))
                   for r in theirs[2:4]]
        if b_grants:
            forged += [GRANT.pack(theirs[4].gen, theirs[4].addr, theirs[4].size, 2 ** 62, 7,
                                  GRANT.unpack(b_grants[0])[5])]
        status, body = raw.call(op_grant, len(forged), 0, b"".join(forged))
        refused.append(status != 0 or (len(body) == len(forged) and all(body)))
        for r in theirs[:5]:
            status, body = raw.read(r.addr, r.size, r.gen)
            refused.append(status == UNAUTHORIZED)

        # 3. B's own valid grants, installed, used on A's addresses and generations
        if b_grants:
            status, body = raw.call(op_grant, len(b_grants), 0, b"".join(b_grants))
            assert status == 0 and body == bytes(len(b_grants))  # B's own: kept
            ok, data = raw.read(own[0].addr, own[0].size, own[0].gen)  # control: B's own bytes
            assert ok == 0 and data == mine["own-0"]
            for r in theirs[:4]:
                for addr_, gen in ((r.addr, own[0].gen), (own[0].addr, r.gen), (r.addr, r.gen)):
                    status, _ = raw.read(addr_, SIZE, gen)
                    refused.append(status == UNAUTHORIZED)
            past = own[0].addr + own[0].size  # B's grant, stretched past its allocation
            status, _ = raw.read(own[0].addr, own[0].size + SIZE, own[0].gen)
            refused.append(status == UNAUTHORIZED)
            status, _ = raw.read(past, SIZE, own[0].gen)
            refused.append(status == UNAUTHORIZED)
            status, _ = raw.call(protocol.OP_WRITE, theirs[0].addr, own[0].gen, b"\xcc" * SIZE)
            refused.append(status == UNAUTHORIZED)  # B's generation, A's address
            status, _ = raw.call(protocol.OP_RETIRE, 1, 0, struct.pack("<Q", theirs[1].gen))
            refused.append(status == UNAUTHORIZED)
        leaked = bytes(raw.got)
        raw.close()

        # 4. malformed GRANT frames close only their own connection
        for count, payload in ((0, b""), (1, b"x" * 10), (5000, b"")):
            bad = Raw(endpoint, TOK["b"])
            bad.sock.sendall(protocol.REQ.pack(protocol.MAGIC, protocol.VERSION, op_grant, 0,
                                               99, count, len(payload) or 56 * count, 0) + payload)
            bad.sock.settimeout(10)
            try:
                tail = bad.sock.recv(1 << 16)
            except OSError:
                tail = b""
            assert not tail or protocol.RESP.unpack(tail[:protocol.RESP.size])[1] != 0
            bad.close()

        assert all(refused), [i for i, ok in enumerate(refused) if not ok]
        _assert_no_leak(values, leaked)
        _assert_intact(a, values, sums)
        assert a.engine.config.protocol == b.engine.config.protocol == "tcp"  # never shm
        assert all(b.get(k) == v for k, v in mine.items())  # B's own paths, through grants
        b.put("after", b"x" * 1000)
        a.put("after", b"y" * 1000)
        assert b.get("after") == b"x" * 1000 and a.get("after") == b"y" * 1000
        b.remove("after", force=True)
        assert not b.exists("after") and a.get("after") == b"y" * 1000
        files = _shm_files(seg.pid)
        assert files
        for name in files:  # same-host tenants of other Unix users: the OS keeps them out
            assert stat.S_IMODE(os.stat(name).st_mode) & 0o077 == 0, name


def _assert_no_leak(values: dict[str, bytes], got: bytes) -> None:
    """Not one 64-byte piece of A's values is among the bytes B received."""
    leaked = [k for k, v in values.items()
              if any(v[i:i + 64] in got for i in range(0, len(v), 4096))]
    assert not leaked, f"tenant B received bytes of {len(leaked)} of A's values"


def _assert_intact(a: StoreClient, values: dict[str, bytes], sums: dict[str, bytes]) -> None:
    wrong = sum(sum(x != y for x, y in zip(a.get(k), values[k])) for k in values)
    assert wrong == 0 and a.corrupt_reads == 0, f"{wrong} wrong bytes in A's values"
    assert all(hashlib.sha256(a.get(k)).digest() == sums[k] for k in values)


def _shm_files(pid: int) -> list[str]:
    """The /dev/shm files the segment process maps."""
    with open(f"/proc/{pid}/maps") as f:
        return sorted({line.split()[-1] for line in f if "/dev/shm/" in line
                       and os.path.exists(line.split()[-1])})


def test_a_tenants_range_puts_and_reads_go_through_its_grants(pool):
    """The Mooncake facade's put sessions and range reads (``store.client.ranges``) install
    the grants of their PutStart and lookup answers, so a tenant's range I/O works at a
    segment that checks grants (before the merge, a tenant's range write was refused)."""
    import numpy as np

    from kvplane.store.client.ranges import Ranges

    addr, _ = pool
    with StoreClient(master=addr, token=TOK["b"], timeout=10) as b:
        io = Ranges(b)
        value = np.frombuffer(os.urandom(2 * SIZE), dtype=np.uint8).copy()
        back = np.zeros_like(value)
        src, dst = value.ctypes.data, back.ctypes.data
        b.engine.register_memory(src, value.nbytes)
        b.engine.register_memory(dst, back.nbytes)
        (res,) = io.reserve(["ranged"], [value.nbytes], None)
        assert res.code == 0
        halves = [(0, src, SIZE), (SIZE, src + SIZE, SIZE)]
        assert io.write(res, halves) == [SIZE, SIZE]
        assert io.commit([("ranged", res)]) == [0]
        (found,), lease_end = io.lookup(["ranged"])
        assert io.read(found, [(SIZE, dst + SIZE, SIZE), (0, dst, SIZE)], lease_end) == [SIZE, SIZE]
        assert bytes(back) == bytes(value)
        assert b.get("ranged") == bytes(value)
