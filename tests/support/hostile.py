"""A hostile peer for tests: junk frames, oversized claims and idle sockets against one port.

Run as a process so its work does not share the test's interpreter:

    python -m tests.support.hostile --port P --kind rpc|data|http|zmq [--garbage 1000]
        [--claims 200] [--idle 2000] [--hold 3] [--seed 0]

Phases, in order: ``garbage`` connections that each send one frame of seeded random bytes and
close; ``claims`` connections that each send a header claiming a 16 MiB frame (plus 1 KiB of it)
and stay open; ``idle`` connections that send nothing and stay open. Everything is held for
``hold`` seconds, then closed. Prints one JSON line: what was attempted and what the server
did (connections refused, closed on us). Raises its own RLIMIT_NOFILE as needed.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import socket
import struct
import sys
import time

CLAIM = 16 << 20
_ZMTP_PLAIN = (b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"PLAIN".ljust(20, b"\x00")
               + b"\x00" + b"\x00" * 31)


def claim_frame(kind: str) -> bytes:
    """The first bytes of a frame that claims 16 MiB, for a listener of ``kind``."""
    if kind == "rpc":
        return struct.pack("<I", CLAIM) + b"\x00" * 1024
    if kind == "data":  # a WRITE header with a 16 MiB payload
        from kvplane.transfer import protocol

        return protocol.pack_req(protocol.OP_WRITE, 1, 0, CLAIM) + b"\x00" * 1024
    if kind == "http":
        return (b"PUT /metadata?key=x HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % CLAIM) + b"x" * 1024
    if kind == "zmq":  # a ZMTP 3 greeting, then a long command frame of 16 MiB
        return _ZMTP_PLAIN + b"\x06" + struct.pack(">Q", CLAIM) + b"\x00" * 1024
    raise ValueError(f"unknown kind {kind!r}")


def raise_nofile(need: int) -> None:
    """Raise the soft RLIMIT_NOFILE to at least ``need`` (up to the hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


class Tally:
    """What the server did to us."""

    def __init__(self) -> None:
        self.opened = self.refused = self.closed_by_server = 0

    def connect(self, addr: tuple[str, int]) -> socket.socket | None:
        try:
            s = socket.create_connection(addr, timeout=5)
        except OSError:
            self.refused += 1
            return None
        self.opened += 1
        return s


def _send(s: socket.socket, data: bytes) -> None:
    try:
        s.sendall(data)
    except OSError:
        pass


def _count_closed(socks: list[socket.socket]) -> int:
    closed = 0
    for s in socks:
        try:
            s.setblocking(False)
            if s.recv(1 << 16) == b"":
                closed += 1
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
    return closed


def run(host: str, port: int, kind: str, garbage: int, claims: int, idle: int, hold: float,
        seed: int) -> dict[str, object]:
    """Run the three phases (see the module docstring); returns the tally."""
    raise_nofile(claims + idle + 512)
    rng = random.Random(seed)
    addr = (host, port)
    tally = Tally()
    t0 = time.monotonic()
    for _ in range(garbage):
        s = tally.connect(addr)
        if s is not None:
            _send(s, rng.randbytes(64))
            s.close()
    held: list[socket.socket] = []
    frame = claim_frame(kind)
    for _ in range(claims):
        s = tally.connect(addr)
        if s is not None:
            _send(s, frame)
            held.append(s)
    for _ in range(idle):
        s = tally.connect(addr)
        if s is not None:
            held.append(s)
    attack_s = time.monotonic() - t0
    time.sleep(hold)
    tally.closed_by_server = _count_closed(held)
    for s in held:
        s.close()
    return {"kind": kind, "seed": seed, "garbage": garbage, "claims": claims, "idle": idle,
            "opened": tally.opened, "refused": tally.refused,
            "closed_by_server": tally.closed_by_server, "attack_s": round(attack_s, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--kind", choices=("rpc", "data", "http", "zmq"), required=True)
    ap.add_argument("--garbage", type=int, default=1000)
    ap.add_argument("--claims", type=int, default=200)
    ap.add_argument("--idle", type=int, default=2000)
    ap.add_argument("--hold", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(json.dumps(run(a.host, a.port, a.kind, a.garbage, a.claims, a.idle, a.hold, a.seed)),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
