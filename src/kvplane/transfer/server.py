"""The engine's TCP listener: serves READ/WRITE/DESCRIBE frames against registered memory.

The only module of ``kvplane.transfer`` that binds sockets (through ``common.listener``): each
connection gets one named daemon thread with blocking I/O (the fastest data path in
CPython: ``recv_into`` straight into registered memory, ``sendmsg`` straight out of it).
A malformed or hostile frame closes that connection and nothing else. A new connection is
unauthenticated (``kvplane.common.guard``): with a token it must send HELLO, and only HELLO,
within the handshake timeout; without one its first well-formed frame authenticates it. An
authenticated connection idle past the idle timeout is closed. Bad peers are logged once per
peer at a time.

With ``require_grants`` (a store segment serving tenants), a connection that authenticated with
one of ``extra_tokens`` is bound to that token's tenant identity (``grants.tenant_id``), and
every READ, WRITE, READV/WRITEV entry and RETIRE generation it sends is checked against the
grants its tenant installed (``grants.GrantTable``, ``OP_GRANT``) before any byte moves. The
listener's own token (the service token) needs no grant.

A READ or WRITE frame on a device region (no host view) is staged through the engine's device
lanes (``kvplane.transfer.staging``): a READ's bytes are copied to host staging chunk by chunk
before they are sent (a failed first copy answers an error; a later one drops the connection,
the answer having begun), a WRITE's bytes are received into staging and copied to the device,
and the WRITE is acknowledged only after every copy finished (else answered with the device's
error). READV/WRITEV entries on device regions are refused per entry (the initiator sends
device ranges as READ/WRITE frames).
"""

from __future__ import annotations

import hmac
import logging
import operator
import os
import socket
import struct
import time
from collections.abc import Callable
from contextlib import closing

import msgspec

from kvplane.common import local, metrics
from kvplane.common.deadline import Deadline
from kvplane.common.errors import Fenced, InvalidArgument, KVPlaneError, ProtocolError, Unauthorized
from kvplane.common.guard import Limits, PeerLog
from kvplane.common.listener import Listener
from kvplane.common.sockets import usable_cpus
from kvplane.transfer import grants as grant_mod
from kvplane.transfer import protocol
from kvplane.transfer.fence import Fence
from kvplane.transfer.memory import MemoryTable, Region
from kvplane.transfer.staging import DeviceLanes
from kvplane.transfer.types import RegionKind

log = logging.getLogger(__name__)

PAYLOAD_TIMEOUT = 30.0  # once a header arrived, its payload must follow within this
# busy-poll for the next frame of a peer in a tight loop (never on one CPU: see SPIN_SECONDS)
SERVER_SPIN = 100e-6 if usable_cpus() > 1 else 0.0
_DRAIN = 64 << 10


class _Reject(Exception):
    """Close this connection: reason is a metrics label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(detail or reason)
        self.reason = reason


class DataServer:
    """Serves the registered memory of one engine over TCP.

    Args:
        memory: the engine's region table (bounds checks happen here, per frame).
        describe: returns this engine's encoded segment descriptor.
        host: bind address.
        port: 0 picks a free port; read ``.port``.
        token: shared token; when set, a connection must send HELLO with it first.
        max_frame: largest READ/WRITE length accepted in one frame.
        max_connections: inbound connections beyond this are refused.
        limits: pre-authentication limits (default: from the environment).
        extra_tokens: more tokens HELLO may present.
        require_grants: a connection authenticated with one of ``extra_tokens`` moves bytes
            only under grants (see the module docstring); False: any authenticated peer may
            read and write any registered address (plain transfer-engine use).
        lanes: the engine's device staging, for frames on device regions (None: refused).
    """

    def __init__(self, memory: MemoryTable, describe: Callable[[], bytes], host: str = "127.0.0.1",
                 port: int = 0, token: str = "", max_frame: int = 256 << 20,
                 max_connections: int = 512, limits: Limits | None = None,
                 extra_tokens: tuple[str, ...] = (), require_grants: bool = False,
                 lanes: DeviceLanes | None = None) -> None:
        self.memory = memory
        self.lanes = lanes
        self._describe = describe
        self._tokens = [t.encode() for t in (token, *extra_tokens) if t]
        # per token, the tenant identity its connections are bound to (None: needs no grant)
        self._ids = [grant_mod.tenant_id(t.decode()) if require_grants and (t != token.encode()
                     or not token) else None for t in self._tokens]
        self.grants = grant_mod.GrantTable()
        self.max_frame = max_frame
        self.max_connections = max_connections
        self.rejected = 0
        self.fence = Fence()  # generations this listener refuses (store allocations)
        self.frames = 0  # frames served (tests use it to prove a path did not touch TCP)
        self._frames = {op: metrics.SERVER_FRAMES.labels(name) for op, name in protocol.OPS.items()}
        self.peer_log = PeerLog(log)
        self._listener = Listener(self._serve, host, port, "te", max_connections,
                                  lambda: self._count_reject("too_many_connections"),
                                  limits=limits, local=True)
        self.limits = self._listener.limits
        self.host, self.port = self._listener.host, self._listener.port
        self._conns = self._listener.conns

    def _count_reject(self, reason: str) -> None:
        self.rejected += 1
        metrics.SERVER_REJECTED.labels(reason).inc()

    # -- one connection -------------------------------------------------------------------
    def _serve(self, conn: socket.socket) -> None:
        metrics.SERVER_CONNECTIONS.inc()
        hdr = bytearray(protocol.REQ.size)
        hview = memoryview(hdr)
        authed = False
        tid: bytes | None = None  # the tenant this connection is bound to (None: no grants)
        conn.settimeout(None)
        protocol.set_io_timeout(conn, self.limits.handshake_timeout)
        quick, done_at = False, time.perf_counter()
        try:
            while not self._listener.closed.is_set():
                # Busy-poll only for a peer that came back quickly last time (a tight loop);
                # otherwise sleep, so idle connections never steal CPU from busy ones.
                try:
                    got = protocol.recv_spin(conn, hview, SERVER_SPIN if quick else 0.0)
                except TimeoutError:
                    if self._expired(authed, done_at):
                        return
                    continue  # idle pooled connection: keep it
                quick = time.perf_counter() - done_at < SERVER_SPIN
                if got == 0:
                    return
                if got < protocol.REQ.size:
                    protocol.recv_exact(conn, hview[got:])
                magic, ver, op, _flags, rid, addr, length, gen = protocol.REQ.unpack(hdr)
                if magic != protocol.MAGIC or ver != protocol.VERSION:
                    raise _Reject("bad_magic")
                if not authed and self._tokens and op != protocol.OP_HELLO:
                    raise _Reject("unauthenticated")
                said_hello = self._handle(conn, op, rid, addr, length, gen, tid)
                if said_hello is not False and said_hello is not True:
                    tid = said_hello  # HELLO with a tenant's token
                if not authed and (said_hello is not False or not self._tokens):
                    authed = True
                    self._authenticated(conn)
                done_at = time.perf_counter()
        except _Reject as exc:
            self._count_reject(exc.reason)
            self.peer_log.warn(self._listener.peer(conn), "closing data connection: %s", exc)
        except (OSError, KVPlaneError):
            pass  # peer went away or stalled mid-frame: drop just this connection
        finally:
            metrics.SERVER_CONNECTIONS.dec()

    def _expired(self, authed: bool, since: float) -> bool:
        """A receive timed out: True closes an authenticated connection idle too long."""
        if not authed:
            raise _Reject("handshake_timeout", "no HELLO within the handshake timeout")
        idle = self.limits.idle_timeout
        if idle and time.perf_counter() - since > idle:
            self._count_reject("idle")
            return True
        return False

    def _authenticated(self, conn: socket.socket) -> None:
        self._listener.authenticated(conn)
        protocol.set_io_timeout(conn, min(PAYLOAD_TIMEOUT, self.limits.idle_timeout or PAYLOAD_TIMEOUT))

    def _handle(self, conn: socket.socket, op: int, rid: int, addr: int, length: int,
                gen: int = 0, tid: bytes | None = None) -> bool | bytes:
        """Serve one frame. Returns False, or for a HELLO True (or the tenant identity its
        token binds the connection to)."""
        counter = self._frames.get(op)
        if counter is not None:
            counter.inc()
        self.frames += 1
        if op == protocol.OP_READ:
            self._read(conn, rid, addr, length, gen, tid)
        elif op == protocol.OP_READV:
            self._readv(conn, rid, addr, length, tid)
        elif op == protocol.OP_WRITE:
            self._write(conn, rid, addr, length, gen, tid)
        elif op == protocol.OP_WRITEV:
            self._writev(conn, rid, addr, length, tid)
        elif op == protocol.OP_RETIRE:
            self._retire(conn, rid, addr, length, tid)
        elif op == protocol.OP_GRANT:
            self._grant(conn, rid, addr, length, tid)
        elif op == protocol.OP_DESCRIBE:
            body = self._describe()
            protocol.send_all(conn, [protocol.pack_resp(0, rid, len(body)), body])
        elif op == protocol.OP_PING:
            conn.sendall(protocol.pack_resp(0, rid, 0))
        elif op == protocol.OP_LOCAL:
            if length:
                raise _Reject("bad_local", f"LOCAL with a {length}-byte body")
            body = msgspec.msgpack.encode(local.info_for(self._listener.local_name, conn))
            protocol.send_all(conn, [protocol.pack_resp(0, rid, len(body)), body])
        elif op == protocol.OP_HELLO:
            return self._hello(conn, rid, length)
        else:
            raise _Reject("bad_op", f"unknown op {op}")
        return False

    def _hello(self, conn: socket.socket, rid: int, length: int) -> bool | bytes:
        if length > protocol.MAX_TOKEN:
            raise _Reject("bad_hello")
        token = bytearray(length)
        protocol.recv_exact(conn, memoryview(token))
        matched = [hmac.compare_digest(bytes(token), t) for t in self._tokens]  # all: constant time
        if self._tokens and not any(matched):
            self._error(conn, rid, Unauthorized("bad token"))
            raise _Reject("bad_token")
        conn.sendall(protocol.pack_resp(0, rid, 0))
        tid = self._ids[matched.index(True)] if self._tokens else None
        return tid if tid is not None else True

    def _grant(self, conn: socket.socket, rid: int, count: int, length: int,
               tid: bytes | None) -> None:
        """Install grants for this connection's tenant (see protocol); ignored without one."""
        if not 0 < count <= grant_mod.MAX_GRANTS or length != count * grant_mod.GRANT_SIZE:
            raise _Reject("bad_grant", f"GRANT of {count} grants in {length} bytes")
        body = bytearray(length)
        protocol.recv_exact(conn, memoryview(body))
        codes = self.grants.install(tid, body) if tid is not None else [0] * count
        protocol.send_all(conn, [protocol.pack_resp(0, rid, count), bytes(codes)])

    def _refuse(self, conn: socket.socket, rid: int, what: str) -> None:
        self._count_reject("no_grant")
        self._error(conn, rid, Unauthorized(f"{what}: no grant for this tenant"))

    def _check_length(self, length: int) -> None:
        if length > self.max_frame:
            raise _Reject("oversized", f"frame of {length} bytes > max_frame {self.max_frame}")

    def _read(self, conn: socket.socket, rid: int, addr: int, length: int, gen: int = 0,
              tid: bytes | None = None) -> None:
        self._check_length(length)
        if tid is not None and not self.grants.admits(tid, gen, addr, length, grant_mod.READ):
            self._refuse(conn, rid, "READ")
            return
        try:
            region = self.memory.find(addr, length)
            if not self.fence.admit(gen):
                raise Fenced(f"generation {gen:#x} is fenced or from another master epoch")
        except KVPlaneError as exc:
            self._error(conn, rid, exc)
            return
        if region.kind == "file":
            protocol.send_all(conn, [protocol.pack_resp(0, rid, length)])
            _sendfile(conn, region, addr - region.addr, length)
            return
        if region.kind == RegionKind.DEVICE:
            self._read_device(conn, rid, region, addr, length)
            return
        off = addr - region.addr
        protocol.send_all(conn, [protocol.pack_resp(0, rid, length),
                                 region.view[off:off + length]])  # type: ignore[index]  # file regions returned above

    def _read_device(self, conn: socket.socket, rid: int, region: Region, addr: int,
                     length: int) -> None:
        """A READ of device memory: each chunk copied to host staging, then sent."""
        if self.lanes is None:
            self._error(conn, rid, InvalidArgument("this listener serves no device memory"))
            return
        try:
            chunks = self.lanes.serve_read(region, addr, length, Deadline.after(PAYLOAD_TIMEOUT))
        except KVPlaneError as exc:
            self._error(conn, rid, exc)
            return
        with closing(chunks):
            try:
                first = next(chunks)
            except KVPlaneError as exc:  # nothing sent yet: the initiator gets the error
                self._error(conn, rid, exc)
                return
            protocol.send_all(conn, [protocol.pack_resp(0, rid, length), first])
            try:
                for view in chunks:
                    protocol.send_all(conn, [view])
            except KVPlaneError as exc:  # mid-answer: only dropping the connection tells
                raise _Reject("device_copy", f"device copy failed mid-READ: {exc}") from exc

    def _readv(self, conn: socket.socket, rid: int, count: int, length: int,
               tid: bytes | None = None) -> None:
        """Many READs in one frame; each entry is checked and fenced on its own (see protocol)."""
        if not 0 < count <= protocol.MAX_READV or length != count * protocol.READV_ENTRY.size:
            raise _Reject("bad_readv", f"READV of {count} entries in {length} bytes")
        table = bytearray(length)
        protocol.recv_exact(conn, memoryview(table))
        rows = struct.unpack(f"<{3 * count}Q", table)
        admitted = self.fence.admit_many(list(rows[2::3]))  # one lock, one instant
        refused = Fenced.code
        if tid is not None:  # a tenant's entries: each also needs its grant
            refused = Unauthorized.code
            admitted = [ok and self.grants.admits(tid, g, a, n, grant_mod.READ)
                        for a, n, g, ok in zip(rows[0::3], rows[1::3], rows[2::3], admitted)]
        whole = self._readv_whole(rows, admitted)
        if whole is not None:  # every entry admitted, all in one memory region
            total = sum(rows[1::3])
            self._check_length(total)
            protocol.send_all(conn, [protocol.pack_resp(0, rid, total), bytes(4 * count), *whole])
            return
        codes: list[int] = []
        parts: list[bytes | memoryview] = []
        total = 0
        region: Region | None = None
        lo = hi = 0  # the bounds of ``region`` (the entries of one frame mostly share one)
        fd = -1
        view: memoryview | None = None
        limit = self.max_frame
        for addr, n, _gen, ok in zip(rows[0::3], rows[1::3], rows[2::3], admitted):
            if n > limit:
                self._check_length(n)
            if not (lo <= addr and addr + n <= hi) or view is None:
                try:
                    region = self._find(region, addr, n)
                except KVPlaneError as exc:
                    codes.append(exc.code)
                    continue
                lo, hi, view, fd = region.addr, region.end, region.view, region.fd
                if region.kind == "file":
                    view = None
            if not ok:
                codes.append(refused)
                continue
            off = addr - lo
            parts.append(view[off:off + n] if view is not None else os.pread(fd, n, off))
            codes.append(0)
            total += n
        self._check_length(total)
        protocol.send_all(conn, [protocol.pack_resp(0, rid, total),
                                 struct.pack(f"<{count}i", *codes), *parts])

    def _readv_whole(self, rows: tuple[int, ...], admitted: list[bool]
                     ) -> list[memoryview] | None:
        """The payloads of a READV whose entries were all admitted and all lie in one memory
        region, sliced a list at a time; None otherwise (then entry by entry)."""
        addrs, lens = rows[0::3], rows[1::3]
        if not all(admitted) or max(lens) > self.max_frame:
            return None
        lo = min(addrs)
        try:
            region = self.memory.find(lo, max(map(operator.add, addrs, lens)) - lo)
        except KVPlaneError:
            return None
        view, base = region.view, region.addr
        if view is None or region.kind == "file":
            return None
        return [view[a - base:a - base + n] for a, n in zip(addrs, lens)]

    def _write(self, conn: socket.socket, rid: int, addr: int, length: int, gen: int = 0,
               tid: bytes | None = None) -> None:
        self._check_length(length)
        try:
            if tid is not None and not self.grants.admits(tid, gen, addr, length, grant_mod.WRITE):
                raise Unauthorized("WRITE: no grant for this tenant")
            region = self.memory.find(addr, length)
            if not self.fence.begin_write(gen):  # counted in progress until end_write
                raise Fenced(f"generation {gen:#x} is fenced or from another master epoch")
        except KVPlaneError as exc:
            _drain(conn, length)  # keep the stream in sync, touch no memory
            self._error(conn, rid, exc)
            return
        off = addr - region.addr
        failed: KVPlaneError | None = None
        try:
            if region.kind == "file":
                _recv_to_file(conn, region, off, length)
            elif region.kind == RegionKind.DEVICE:
                failed = self._write_device(conn, region, addr, length)
            else:
                protocol.recv_exact(conn, region.view[off:off + length])  # type: ignore[index]  # not a file region: it has a view
        finally:
            self.fence.end_write(gen)
        if failed is not None:
            self._error(conn, rid, failed)
            return
        conn.sendall(protocol.pack_resp(0, rid, 0))

    def _write_device(self, conn: socket.socket, region: Region, addr: int, length: int
                      ) -> KVPlaneError | None:
        """Receive a WRITE's payload for device memory through staging; returns once every
        copy to the device finished, with the error of a failed one (the payload is received
        whole either way)."""
        if self.lanes is None:
            _drain(conn, length)
            return InvalidArgument("this listener serves no device memory")
        return self.lanes.serve_write(region, addr, length, Deadline.after(PAYLOAD_TIMEOUT),
                                      lambda view: protocol.recv_exact(conn, view))

    def _find(self, last: Region | None, addr: int, n: int) -> Region:
        """The region holding [addr, addr+n) for a READV/WRITEV entry: ``last`` when it does
        (the entries of one frame mostly share a region), else looked up (raises
        AddressNotRegistered; InvalidArgument for device memory, which READ/WRITE frames
        stage and vectored entries never do)."""
        if last is not None and last.addr <= addr and addr + n <= last.end:
            return last
        region = self.memory.find(addr, n)
        if region.kind == RegionKind.DEVICE:
            raise InvalidArgument(f"{addr:#x} is device memory: READ/WRITE frames only")
        return region

    def _retire(self, conn: socket.socket, rid: int, count: int, length: int,
                tid: bytes | None = None) -> None:
        """Refuse frames of the generations that follow from now on (see protocol); a
        tenant's connection only with a RETIRE grant for each."""
        if not 0 < count <= protocol.MAX_RETIRE or length != count * protocol.RETIRE_ENTRY.size:
            raise _Reject("bad_retire", f"RETIRE of {count} generations in {length} bytes")
        body = bytearray(length)
        protocol.recv_exact(conn, memoryview(body))
        gens = [g for (g,) in protocol.RETIRE_ENTRY.iter_unpack(body)]
        if tid is not None and not self.grants.may_retire(tid, gens):
            self._refuse(conn, rid, "RETIRE")
            return
        self.fence.retire(gens)
        conn.sendall(protocol.pack_resp(0, rid, 0))

    def _writev(self, conn: socket.socket, rid: int, count: int, length: int,
                tid: bytes | None = None) -> None:
        """Many WRITEs in one frame; each entry is checked and fenced on its own (see
        protocol), and every payload arrives through one scatter receive."""
        table_len = count * protocol.READV_ENTRY.size
        if not 0 < count <= protocol.MAX_READV or length < table_len:
            raise _Reject("bad_writev", f"WRITEV of {count} entries in {length} bytes")
        self._check_length(length)
        table = bytearray(table_len)
        protocol.recv_exact(conn, memoryview(table))
        entries = list(protocol.READV_ENTRY.iter_unpack(table))
        if table_len + sum(n for _, n, _ in entries) != length:
            raise _Reject("bad_writev", "WRITEV payloads do not add up to its length")
        codes: list[int] = []
        views: list[memoryview] = []
        files: list[tuple[Region, int, bytearray]] = []
        begun: list[int] = []
        region: Region | None = None
        try:
            for addr, n, gen in entries:
                try:
                    if tid is not None and not self.grants.admits(tid, gen, addr, n,
                                                                  grant_mod.WRITE):
                        raise Unauthorized("WRITEV entry: no grant for this tenant")
                    region = self._find(region, addr, n)
                    if not self.fence.begin_write(gen):  # counted in progress until end_write
                        raise Fenced(f"generation {gen:#x} is fenced or from another master epoch")
                except KVPlaneError as exc:
                    codes.append(exc.code)
                    views += _scratch_views(n)  # received and dropped, in bounded memory
                    continue
                begun.append(gen)
                codes.append(0)
                off = addr - region.addr
                if region.kind == "file":
                    buf = bytearray(n)
                    files.append((region, off, buf))
                    views.append(memoryview(buf))
                else:
                    views.append(region.view[off:off + n])  # type: ignore[index]  # not a file region: it has a view
            protocol.recv_scatter(conn, views)
            for file_region, off, buf in files:
                os.pwrite(file_region.fd, buf, off)
        finally:
            for gen in begun:
                self.fence.end_write(gen)
        protocol.send_all(conn, [protocol.pack_resp(0, rid, 4 * count),
                                 struct.pack(f"<{count}i", *codes)])

    @staticmethod
    def _error(conn: socket.socket, rid: int, exc: KVPlaneError) -> None:
        msg = str(exc).encode()[: protocol.MAX_ERROR]
        protocol.send_all(conn, [protocol.pack_resp(exc.code, rid, len(msg)), msg])

    def close(self) -> None:
        """Stop accepting and close every connection (idempotent)."""
        self._listener.close()


def _scratch_views(n: int) -> list[memoryview]:
    """Views totalling ``n`` bytes, all over one scratch buffer of at most ``_DRAIN`` bytes
    (a refused WRITEV entry's payload is received into them and dropped)."""
    scratch = memoryview(bytearray(min(n, _DRAIN) or 1))
    return [scratch[:min(len(scratch), n - k)] for k in range(0, n, len(scratch))]


def _drain(conn: socket.socket, length: int) -> None:
    scratch = memoryview(bytearray(min(length, _DRAIN) or 1))
    left = length
    while left > 0:
        n = min(left, len(scratch))
        protocol.recv_exact(conn, scratch[:n])
        left -= n


def _sendfile(conn: socket.socket, region: Region, off: int, length: int) -> None:
    sent = 0
    while sent < length:
        n = os.sendfile(conn.fileno(), region.fd, off + sent, length - sent)
        if n == 0:
            raise ProtocolError("file region shorter than advertised")
        sent += n


def _recv_to_file(conn: socket.socket, region: Region, off: int, length: int) -> None:
    buf = memoryview(bytearray(min(length, _DRAIN) or 1))
    done = 0
    while done < length:
        n = min(length - done, len(buf))
        protocol.recv_exact(conn, buf[:n])
        os.pwrite(region.fd, buf[:n], off + done)
        done += n
