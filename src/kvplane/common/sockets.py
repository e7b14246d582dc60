"""Blocking-socket helpers shared by the data plane and the control RPC.

Deadlines are kernel timeouts (SO_RCVTIMEO/SO_SNDTIMEO) on blocking sockets: a call blocked past
them fails with EAGAIN, raised here as ``TimeoutError``. Replies are first awaited with a short
busy-poll (``recv_spin``), because waking a sleeping thread on an idle core costs more than a
small round trip.
"""

from __future__ import annotations

import os
import socket
import struct
import time

from kvplane.common.errors import Unavailable

_TIMEVAL = struct.Struct("ll")


def set_io_timeout(sock: socket.socket, seconds: float) -> None:
    """Kernel-side send/receive timeouts (SO_RCVTIMEO/SO_SNDTIMEO) on a blocking socket.

    Unlike ``settimeout`` this adds no poll() before every call: a blocked call fails with
    EAGAIN after ``seconds``, which the helpers here raise as ``TimeoutError``.
    """
    sec = max(seconds, 1e-3)
    tv = _TIMEVAL.pack(int(sec), int((sec % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def ran_out(sock: socket.socket, option: int, since: float) -> bool:
    """After a blocking call that moved only part of its bytes: True if the socket's kernel
    timeout (``option``: SO_RCVTIMEO or SO_SNDTIMEO) has passed since ``since`` (monotonic),
    so the short return was that timeout, not a signal. The next call would wait a whole
    timeout again: a peer that stalls mid-frame would hold the caller for several timeouts,
    past its deadline (a 512 KiB write to a stopped segment over a Unix socket, whose buffer
    holds about 200 KiB, took two)."""
    try:
        sec, usec = _TIMEVAL.unpack(sock.getsockopt(socket.SOL_SOCKET, option, _TIMEVAL.size))
    except (AttributeError, OSError, struct.error):
        return False  # not a kernel socket (a test double): no kernel timeout to check
    limit = float(sec + usec / 1e6)
    return limit > 0 and time.monotonic() - since >= 0.9 * limit


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``.

    Raises:
        Unavailable: the peer closed the connection.
        TimeoutError: the kernel timeout expired with bytes still missing (once in all: a
            peer that stalls mid-frame costs one timeout, not one per short read).
    """
    got, n = 0, len(view)
    since = time.monotonic()
    try:
        while got < n:
            if got and ran_out(sock, socket.SO_RCVTIMEO, since):
                raise TimeoutError("receive timed out")
            k = sock.recv_into(view[got:] if got else view, 0, socket.MSG_WAITALL)
            if k == 0:
                raise Unavailable("connection closed by peer")
            got += k
    except BlockingIOError as exc:
        raise TimeoutError("receive timed out") from exc


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask: ``taskset``, a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


# Busy-poll this long for a reply before sleeping in the kernel; never on one CPU, where the
# poll holds the only CPU the peer needs to answer (measured: docs/benchmarks.md, issue 32).
SPIN_SECONDS = 200e-6 if usable_cpus() > 1 else 0.0


def poll_spin(sock: socket.socket, view: memoryview, spin: float) -> int:
    """Busy-poll ``sock`` for up to ``spin`` seconds without blocking; returns the bytes
    received into ``view`` (0 = EOF), or -1 if nothing arrived."""
    end = time.perf_counter() + spin
    while True:
        try:
            return sock.recv_into(view, 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            if time.perf_counter() > end:
                return -1


def recv_spin(sock: socket.socket, view: memoryview, spin: float = SPIN_SECONDS) -> int:
    """Receive into ``view`` with a short busy-poll first; returns bytes received (0 = EOF).

    Waking a sleeping thread on an idle core costs tens of microseconds on a VM, more than a
    small request/response round trip itself. A reply that arrives within ``spin`` seconds is
    taken without sleeping; after that the call blocks as usual (kernel timeout applies).
    """
    if spin > 0:
        got = poll_spin(sock, view, spin)
        if got >= 0:
            return got
    try:
        return sock.recv_into(view)
    except BlockingIOError as exc:
        raise TimeoutError("receive timed out") from exc
