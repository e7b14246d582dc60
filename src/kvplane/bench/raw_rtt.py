"""The machine's floor for the cold benchmark: bare TCP round trips between Python processes.

``store_scale.py cold`` side ``raw``. A cold get (lookup, then read), a get after an exists that
names the place (exists, then read) and a put (write, then commit) each need two round trips in
a row, one to a metadata process and one to a data process. This side makes exactly those two
round trips and nothing else: a "master" process answering a 32-byte request with 64 bytes, and
``segments`` "segment" processes, taken in turn, answering with the value (gets) or taking it
and answering with 8 bytes (puts). Blocking sockets with TCP_NODELAY, connected off the clock,
no protocol, no checks, no allocation: what any store built on kernel TCP between processes
that sleep while idle pays at least, here. Stores that keep processes spinning or map the
peer's memory can go under it.

Side ``raw-c`` is the same in C (``raw_rtt.c``, built here with the system's ``cc`` into a
temporary directory; skipped with a reason without one): the machine's floor without an
interpreter.

``python -m kvplane.bench.raw_rtt serve`` prints ``{"port": N}`` and serves until its stdin
closes; ``python -m kvplane.bench.raw_rtt client ...`` prints one JSON line of latencies.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from kvplane.common.errors import Unavailable
from kvplane.common.sockets import recv_exact

C_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "raw_rtt.c")

HEAD = struct.Struct("!II")  # bytes the request carries after the head, bytes to answer


def _serve_conn(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    scratch = memoryview(bytearray(1 << 20))
    reply = bytes(1 << 20)
    with conn:
        while True:
            try:
                recv_exact(conn, scratch[:HEAD.size])
                body, answer = HEAD.unpack(scratch[:HEAD.size])
                if body:
                    recv_exact(conn, scratch[:body])
            except (Unavailable, OSError):
                return
            conn.sendall(memoryview(reply)[:answer])


def serve() -> int:
    """Listen on 127.0.0.1, print the port, answer every connection until stdin closes."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(16)
    print(json.dumps({"port": ls.getsockname()[1]}), flush=True)

    def accept() -> None:
        while True:
            conn, _ = ls.accept()
            threading.Thread(target=_serve_conn, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    sys.stdin.read()  # until the parent closes it (a closed listener would not wake accept)
    return 0


def _round_trip(conn: socket.socket, send: bytes, answer: int, buf: memoryview) -> None:
    conn.sendall(HEAD.pack(len(send), answer) + send)
    recv_exact(conn, buf[:answer])


def client(master: int, segments: list[int], op: str, n: int, size: int) -> dict[str, Any]:
    """``n`` calls of ``op`` (``get``: 32 B to the master, 64 B back, then 32 B to a segment and
    ``size`` back; ``put``: ``size`` to a segment, 8 B back, then 32 B to the master, 64 B
    back), segments in turn; per-call latencies in ns."""
    conns = []
    for port in [master, *segments]:
        c = socket.create_connection(("127.0.0.1", port), timeout=30)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conns.append(c)
    m, segs = conns[0], conns[1:]
    buf = memoryview(bytearray(max(size, 64)))
    small, value = bytes(32), bytes(size)
    lat = []
    try:
        for i in range(n):
            seg = segs[i % len(segs)]
            t = time.perf_counter_ns()
            if op == "put":
                _round_trip(seg, value, 8, buf)
                _round_trip(m, small, 64, buf)
            else:
                _round_trip(m, small, 64, buf)
                _round_trip(seg, small, size, buf)
            lat.append(time.perf_counter_ns() - t)
    finally:
        for c in conns:
            c.close()
    return {"lat": lat}


@functools.cache
def build_c() -> str:
    """The C twin built with ``cc -O2`` (once per process): its path.

    Raises:
        RuntimeError: no ``cc``, no source (an installed wheel), or the build failed.
    """
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not os.path.exists(C_SOURCE):
        raise RuntimeError("no C compiler (cc) or no raw_rtt.c source")
    exe = os.path.join(tempfile.mkdtemp(prefix="kvplane-raw-rtt-"), "raw_rtt")
    out = subprocess.run([cc, "-O2", "-o", exe, C_SOURCE], capture_output=True, text=True,
                         timeout=120)
    if out.returncode:
        raise RuntimeError(f"cc failed: {out.stderr[-500:]}")
    return exe


class Servers:
    """One master-like and ``segments`` segment-like ``serve`` processes, in Python or C."""

    def __init__(self, segments: int, lang: str = "py") -> None:
        from kvplane.common.procs import Proc

        self.cmd = [build_c()] if lang == "c" else [sys.executable, "-m", "kvplane.bench.raw_rtt"]
        self.procs: list[Proc] = []
        try:
            for _ in range(segments + 1):
                self.procs.append(Proc([*self.cmd, "serve"]))
        except BaseException:
            self.close()
            raise
        self.master = int(self.procs[0].info["port"])
        self.segments = [int(p.info["port"]) for p in self.procs[1:]]

    def run(self, op: str, n: int, size: int, timeout: float = 300.0) -> list[int]:
        """One client process doing ``n`` calls of ``op``: its latencies (ns)."""
        segs = ",".join(map(str, self.segments))
        out = subprocess.run([*self.cmd, "client", str(self.master), segs, op, str(n), str(size)],
                             capture_output=True, text=True, timeout=timeout, check=True)
        return list(json.loads(out.stdout)["lat"])

    def close(self) -> None:
        for p in self.procs:
            p.stop()
        self.procs.clear()


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:
        return serve()
    if argv[:1] == ["client"] and len(argv) == 6:
        master, segs, op, n, size = argv[1:]
        print(json.dumps(client(int(master), [int(s) for s in segs.split(",")], op, int(n),
                                int(size))))
        return 0
    print("usage: raw_rtt serve | client MASTER_PORT SEG_PORTS get|put N SIZE", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
