"""The processes a benchmark starts: a kvplane master and segments, and etcd for the HA runs.

Each waits on readiness (the child's ready line, etcd's ``/health``), never on time. The test
tree's harnesses (``tests/support/store_procs.py``, ``services.py``) reuse these; this module
imports only ``kvplane.common`` (never the test kit, never ``tests``).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys

from kvplane.common.procs import Proc, free_port, wait_until

CLI = [sys.executable, "-m", "kvplane.cli.main"]


def spawn_master(*args: str) -> Proc:
    """``kvplane master`` on free ports; ``.info["master"]`` is its address."""
    return Proc([*CLI, "master", "--port", "0", "--admin-port", "0", *args],
                stop_signal=signal.SIGTERM)


def spawn_segment(master: str, size: str = "32MiB", *args: str) -> Proc:
    """``kvplane segment``: contributes ``size`` of shared memory; ``.info["segment"]``."""
    return Proc([*CLI, "segment", "--master", master, "--size", size, *args],
                stop_signal=signal.SIGTERM)


class Service:
    """A server subprocess that prints no ready line; ``url`` tells clients where it is."""

    def __init__(self, args: list[str], url: str) -> None:
        self.url = url
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def stop(self) -> None:
        """Kill and reap the server (idempotent)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        if self.proc.stderr:
            self.proc.stderr.close()


def start_etcd(data_dir: str, timeout: float = 30.0, host: str = "127.0.0.1") -> Service:
    """etcd on free ports of ``host`` (default loopback) with its data in ``data_dir``.

    Raises:
        FileNotFoundError: etcd is not installed. Timeout: it did not report healthy in time.
    """
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
