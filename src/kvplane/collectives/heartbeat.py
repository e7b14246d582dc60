"""UDP heartbeats between the ranks of a process group: who is alive, independent of op progress.

A rank whose process is stopped (SIGSTOP) or wedged keeps its TCP connections open, so only the
absence of heartbeats tells its peers it is gone. One daemon thread per process sends a datagram to
every peer each ``interval`` and records what it hears. Binds 127.0.0.1 only.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time

log = logging.getLogger(__name__)

_BEAT = struct.Struct("<4sHQ")  # magic, rank, incarnation
_MAGIC = b"KVHB"


class Heartbeat:
    """Send and receive heartbeats on a background thread.

    Args:
        rank: this process's rank.
        incarnation: this process's incarnation (a replacement process has a new one).
        interval: seconds between beats.
        timeout: a peer silent for longer is stale.
    """

    def __init__(self, rank: int, incarnation: int, interval: float, timeout: float) -> None:
        self.rank = rank
        self.incarnation = incarnation
        self.interval = interval
        self.timeout = timeout
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        self._lock = threading.Lock()
        self._peers: dict[int, tuple[int, int]] = {}
        self._seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvplane-hb-{rank}", daemon=True)
        self._thread.start()

    def set_peers(self, peers: dict[int, tuple[int, int]]) -> None:
        """Replace the peer table: ``rank -> (udp_port, incarnation)``; new peers start fresh."""
        now = time.monotonic()
        with self._lock:
            for r, v in peers.items():
                if self._peers.get(r) != v:
                    self._seen[r] = now
            self._peers = dict(peers)

    def stale(self, rank: int) -> bool:
        """True if ``rank`` has not been heard from for longer than ``timeout``."""
        with self._lock:
            seen = self._seen.get(rank)
            known = rank in self._peers
        return known and seen is not None and time.monotonic() - seen > self.timeout

    def _run(self) -> None:
        beat = _BEAT.pack(_MAGIC, self.rank, self.incarnation)
        next_beat = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                with self._lock:
                    ports = [p for p, _ in self._peers.values()]
                for port in ports:
                    try:
                        self._sock.sendto(beat, ("127.0.0.1", port))
                    except OSError:
                        pass
                next_beat = now + self.interval
            self._sock.settimeout(max(0.001, next_beat - time.monotonic()))
            try:
                data = self._sock.recv(64)
            except (TimeoutError, OSError):
                continue
            if len(data) != _BEAT.size:
                continue
            magic, rank, inc = _BEAT.unpack(data)
            with self._lock:
                if magic == _MAGIC and self._peers.get(rank, (0, -1))[1] == inc:
                    self._seen[rank] = time.monotonic()

    def close(self) -> None:
        """Stop the thread and close the socket (idempotent)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        self._sock.close()
