"""Real etcd and Redis servers on 127.0.0.1 for tests; wait on their health, not on time.

etcd, ``Service``, ``wait_until`` and ``free_port`` are the product's (``kvplane bench`` starts
etcd too); Redis is only the tests'.
"""

from __future__ import annotations

import shutil
import socket

from kvplane.bench.services import Service, start_etcd
from kvplane.common.procs import free_port, wait_until

__all__ = ["Service", "free_port", "start_etcd", "start_redis", "wait_until"]


def start_redis(timeout: float = 20.0) -> Service:
    """redis-server on a free loopback port, no persistence."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise FileNotFoundError("redis-server not installed (apt-get install redis-server)")
    port = free_port()
    svc = Service([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "no"], f"redis://127.0.0.1:{port}/0")

    def up() -> bool:
        if svc.proc.poll() is not None:
            raise RuntimeError("redis-server exited")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    wait_until(up, timeout, "redis")
    return svc
