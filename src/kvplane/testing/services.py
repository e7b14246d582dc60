"""Start real etcd and Redis servers on 127.0.0.1 for tests; wait on their health, not on time."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable

from kvplane.common.errors import Timeout


def free_port() -> int:
    """A port that was free a moment ago (for servers that cannot bind port 0 themselves)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``check`` (with a short back-off) until it is true or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    while not check():
        if time.monotonic() > deadline:
            raise Timeout(f"{what} not ready within {timeout}s")
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


class Service:
    """A server subprocess; ``url`` tells clients where it is."""

    def __init__(self, args: list[str], url: str) -> None:
        self.url = url
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        if self.proc.stderr:
            self.proc.stderr.close()


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


def start_etcd(data_dir: str, timeout: float = 30.0, host: str = "127.0.0.1") -> Service:
    """etcd on free ports of ``host`` (default loopback) with its data in ``data_dir``."""
    exe = shutil.which("etcd")
    if exe is None:
        raise FileNotFoundError("etcd not installed (apt-get install etcd-server)")
    cport, pport = free_port(), free_port()
    client = f"http://{host}:{cport}"
    peer = f"http://127.0.0.1:{pport}"
    svc = Service([exe, "--data-dir", data_dir, "--listen-client-urls", client,
                   "--advertise-client-urls", client, "--listen-peer-urls", peer,
                   "--initial-advertise-peer-urls", peer, "--initial-cluster", f"default={peer}",
                   "--name", "default"], f"etcd://{host}:{cport}")

    def up() -> bool:
        import httpx

        if svc.proc.poll() is not None:
            raise RuntimeError("etcd exited")
        try:
            return httpx.get(f"{client}/health", timeout=1, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, timeout, "etcd")
    return svc
