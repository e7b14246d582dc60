"""The machine's limits, measured the same way as kvplane: memcpy and a raw socket stream."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time

import numpy as np


def memcpy(size: int, buf_bytes: int, duration: float) -> dict[str, float]:
    """Single-thread numpy copy of ``size`` blocks rotating through ``buf_bytes`` buffers."""
    src = np.full(buf_bytes, 1, np.uint8)
    dst = np.empty(buf_bytes, np.uint8)
    dst.fill(0)  # fault the pages in: a limit is measured on warm memory
    nslots = max(1, buf_bytes // size)
    n, slot = 0, 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < duration or n < 3:
        o = slot * size
        np.copyto(dst[o:o + size], src[o:o + size])
        slot = (slot + 1) % nslots
        n += 1
    el = time.perf_counter() - t0
    return {"ops_s": n / el, "gb_s": n * size / el / 1e9}


def _sink(conn, size: int) -> None:
    ls = socket.create_server(("127.0.0.1", 0))
    conn.send(ls.getsockname()[1])
    c, _ = ls.accept()
    buf = memoryview(bytearray(size))
    total = 0
    while True:
        k = c.recv_into(buf, 0, socket.MSG_WAITALL)
        if k == 0:
            break
        total += k
    c.sendall(total.to_bytes(8, "little"))
    c.close()


def raw_stream(size: int, duration: float) -> dict[str, float]:
    """A raw Python TCP stream: ``sendmsg`` of ``size`` blocks, receiver ``recv_into``."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_sink, args=(b, size), daemon=True)
    p.start()
    try:
        s = socket.create_connection(("127.0.0.1", a.recv()), timeout=30)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        data = np.ones(size, np.uint8).data
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < duration or n < 3:
            s.sendall(data)
            n += 1
        s.shutdown(socket.SHUT_WR)
        got = int.from_bytes(s.recv(8), "little")
        el = time.perf_counter() - t0
        s.close()
        if got != n * size:
            raise RuntimeError(f"raw stream lost bytes: sent {n * size}, received {got}")
        return {"ops_s": n / el, "gb_s": n * size / el / 1e9}
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()


def _responder(conn, size: int) -> None:
    ls = socket.create_server(("127.0.0.1", 0))
    conn.send(ls.getsockname()[1])
    c, _ = ls.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = np.ones(size, np.uint8).data
    req = bytearray(8)
    while c.recv_into(req, 8, socket.MSG_WAITALL) == 8:
        c.sendall(data[:int.from_bytes(req, "little")])
    c.close()


def round_trip(nbytes: int, duration: float) -> list[int]:
    """The floor of a remote get: one raw Python TCP round trip (an 8-byte request, an
    ``nbytes`` answer received with ``recv_into``) to another process; per-call nanoseconds."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_responder, args=(b, nbytes), daemon=True)
    p.start()
    try:
        s = socket.create_connection(("127.0.0.1", a.recv()), timeout=30)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = memoryview(bytearray(nbytes))
        req = nbytes.to_bytes(8, "little")
        lat: list[int] = []
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < duration or len(lat) < 3:
            x = time.perf_counter_ns()
            s.sendall(req)
            got = 0
            while got < nbytes:
                k = s.recv_into(buf[got:], nbytes - got, socket.MSG_WAITALL)
                if k == 0:
                    raise RuntimeError("round-trip responder closed")
                got += k
            lat.append(time.perf_counter_ns() - x)
        s.close()
        return lat
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
