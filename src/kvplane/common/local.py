"""Same-host connections over Unix sockets: a TCP client of a server on its own host moves to
the server's Unix socket after connecting, as a Redis client uses ``unixsocket``.

Why: on loopback TCP a send to a sleeping peer runs the receiver's TCP input in the sender's
call and wakes it from a softirq; on this class of VM a small round trip with both sides
blocking measured ~68 µs over TCP and ~32 µs over a Unix socket (each send 19 µs against 2 µs;
docs/benchmarks.md, "Same-host Unix sockets"). Both the store master's RPC server and the
transfer engine's data listener offer one.

How a client moves, and why it cannot be led astray:

1. It connects over TCP, as always, and authenticates as always.
2. It asks the server for its local endpoint (RPC ``rpc.local``, data op ``OP_LOCAL``; a data
   connection sends ``OP_LOCAL`` right behind its HELLO, in one send, and the listener answers
   it only after accepting the HELLO: one round trip for both). The server answers
   :class:`LocalInfo`: a random name in the abstract Unix namespace (no file to
   clean up; it goes with the process), its pid, and the TCP peer address it sees.
3. The client moves only if the connection is direct and on its own host: the peer address the
   server saw is this socket's own address (a relay or proxy in between sees another, so the
   client stays behind it: fault-injecting relays in tests and sidecar proxies keep working),
   and the Unix peer's pid (``SO_PEERCRED``) is the pid the server named (a process squatting a
   name the server no longer holds is refused). Then it authenticates again on the Unix socket
   (the server's checks are the same on both) and closes the TCP connection.

Anything else (an older server, another network namespace, a different pid namespace, a name
that cannot be reached) leaves the TCP connection in use. ``KVPLANE_LOCAL_SOCKETS=0`` turns it
off for servers (no name is offered) and clients (none is asked for). Imports only the
standard library, msgspec and ``kvplane.common.envs``.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import struct

import msgspec

from kvplane.common import envs

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class LocalInfo(msgspec.Struct, array_like=True, frozen=True):
    """A server's answer to "your local endpoint?" (``name``: abstract Unix socket name, without
    the leading NUL; empty: none offered)."""

    name: str
    pid: int
    peer: str  # the TCP peer address the server saw, "host:port"


def enabled() -> bool:
    """Whether this process offers and uses same-host Unix sockets (``KVPLANE_LOCAL_SOCKETS``)."""
    return bool(envs.get("KVPLANE_LOCAL_SOCKETS"))


def bind() -> tuple[socket.socket, str] | None:
    """A bound (not listening) abstract Unix socket with a fresh random name, or None when
    disabled or unavailable."""
    if not enabled():
        return None
    name = f"kvplane-{os.getpid()}-{secrets.token_hex(8)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + name)
    except OSError:
        sock.close()
        return None
    return sock, name


def address(addr: object) -> str:
    """``host:port`` of a TCP socket address (what :attr:`LocalInfo.peer` carries)."""
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"{addr[0]}:{addr[1]}"
    return ""


def same_host(sock: socket.socket) -> bool:
    """True if ``sock`` (a connected TCP socket) reaches a server on this host: a loopback peer,
    or one at this socket's own address."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or not enabled():
        return False
    try:
        peer, own = sock.getpeername()[0], sock.getsockname()[0]
        return peer == own or ipaddress.ip_address(peer).is_loopback
    except (OSError, ValueError):
        return False


def info_for(name: str, conn: socket.socket) -> LocalInfo:
    """What a server that offers ``name`` answers on ``conn``: none (an empty name) when it
    offers none or ``conn`` is already one of its Unix connections."""
    if not name or conn.family == socket.AF_UNIX:
        return LocalInfo("", 0, "")
    try:
        peer = address(conn.getpeername())
    except OSError:
        peer = ""
    return LocalInfo(name, os.getpid(), peer)


def connect(info: LocalInfo, tcp: socket.socket, timeout: float) -> socket.socket | None:
    """The Unix socket to move ``tcp``'s connection to, or None to stay on TCP (see the module
    docstring: a direct connection, and the pid the server named)."""
    if not info.name or info.pid <= 0:
        return None
    try:
        if info.peer != address(tcp.getsockname()):
            return None  # something between us and the server: stay behind it
    except OSError:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(max(timeout, 1e-3))
        sock.connect("\0" + info.name)
        pid, _uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                        _UCRED.size))
        if pid != info.pid:
            sock.close()
            return None
        sock.settimeout(None)
        return sock
    except OSError:
        sock.close()
        return None
