"""Spawn store processes (master, segment, client worker) for tests; each waits on readiness."""

from __future__ import annotations

import signal
import sys

from kvplane.testing.procs import Proc

CLI = [sys.executable, "-m", "kvplane.cli.main"]


def spawn_master(*args: str) -> Proc:
    """``kvplane master`` on free ports; ``.info["master"]`` is its address."""
    return Proc([*CLI, "master", "--port", "0", "--admin-port", "0", *args],
                stop_signal=signal.SIGTERM)


def spawn_segment(master: str, size: str = "32MiB", *args: str) -> Proc:
    """``kvplane segment``: contributes ``size`` of shared memory; ``.info["segment"]``."""
    return Proc([*CLI, "segment", "--master", master, "--size", size, *args],
                stop_signal=signal.SIGTERM)


def spawn_worker(master: str, *args: str) -> Proc:
    """A store client process answering JSON commands (see kvplane.testing.store_client_proc)."""
    return Proc([sys.executable, "-m", "kvplane.testing.store_client_proc", "--master", master, *args])


def spawn_client_server(master: str, size: str = "64MiB", *args: str) -> Proc:
    """``kvplane client-server`` on a free port: ``.info["client_server"]`` is its address."""
    return Proc([*CLI, "client-server", "--master", master, "--port", "0", "--size", size, *args],
                stop_signal=signal.SIGTERM)
