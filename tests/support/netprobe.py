"""Tiny network probes for test beds: a sink server, a timed sender, a connect check.

    python -m tests.support.netprobe serve [--host H]        -> {"port": P}; then one JSON line per connection
    python -m tests.support.netprobe send HOST PORT BYTES    -> {"bytes": N, "seconds": S}
    python -m tests.support.netprobe connect HOST PORT TIMEOUT -> {"ok": bool, "error": str}

Every line is JSON on stdout. ``serve`` stops when its stdin closes. Imports only the stdlib.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

CHUNK = 1 << 20


def _say(**kv: object) -> None:
    sys.stdout.write(json.dumps(kv) + "\n")
    sys.stdout.flush()


def _sink(conn: socket.socket) -> None:
    got, t0 = 0, time.monotonic()
    buf = bytearray(CHUNK)
    with conn:
        conn.settimeout(120)
        try:
            while True:
                n = conn.recv_into(buf)
                if n == 0:
                    break
                got += n
            conn.sendall(b"k")  # tell the sender every byte arrived
        except OSError:
            pass
    _say(received=got, seconds=time.monotonic() - t0)


def serve(host: str) -> None:
    """Accept connections and count what each sends; stop when stdin closes."""
    srv = socket.create_server((host, 0))
    _say(port=srv.getsockname()[1])

    def accept() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=_sink, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    sys.stdin.read()
    srv.close()


def send(host: str, port: int, nbytes: int) -> None:
    """Send ``nbytes`` and wait for the sink's acknowledgement; print the time it took."""
    payload = memoryview(bytearray(CHUNK))
    t0 = time.monotonic()
    with socket.create_connection((host, port), timeout=30) as s:
        s.settimeout(120)
        left = nbytes
        while left > 0:
            n = s.send(payload[: min(left, CHUNK)])
            left -= n
        s.shutdown(socket.SHUT_WR)
        s.recv(1)
    _say(bytes=nbytes, seconds=time.monotonic() - t0)


def connect(host: str, port: int, timeout: float) -> None:
    """Try one TCP connect within ``timeout``."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        _say(ok=True, error="")
    except OSError as exc:
        _say(ok=False, error=f"{type(exc).__name__}: {exc}")


def main(argv: list[str]) -> None:
    cmd = argv[0] if argv else ""
    if cmd == "serve":
        serve(argv[2] if len(argv) > 2 and argv[1] == "--host" else "0.0.0.0")
    elif cmd == "send":
        send(argv[1], int(argv[2]), int(argv[3]))
    elif cmd == "connect":
        connect(argv[1], int(argv[2]), float(argv[3]))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
