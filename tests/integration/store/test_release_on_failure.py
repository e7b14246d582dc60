"""Clients and engines release what they took: a failed construction at once (shared memory,
threads, sockets), a forgotten client when its process exits (weakref.finalize at exit)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from kvplane.common.errors import Unauthorized, Unavailable
from kvplane.store import StoreClient
from kvplane.transfer import TransferEngine
from tests.support.services import free_port
from tests.support.store_procs import spawn_master

pytestmark = pytest.mark.timeout(90)


def _own_shm(pid: int | None = None) -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f.startswith(f"kvplane-{pid or os.getpid()}-")]


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


@pytest.fixture
def master():
    proc = spawn_master()
    try:
        yield proc.info["master"]
    finally:
        proc.stop()


def _check_released(build) -> Exception:
    fds, threads, shm = _fds(), _threads(), _own_shm()
    with pytest.raises((Unavailable, Unauthorized)) as info:
        build()
    assert _own_shm() == shm, "shared memory left behind"
    assert _threads() == threads, "threads left behind"
    assert _fds() - fds == set(), "descriptors (sockets, files) left behind"
    return info.value


def test_store_client_without_master_releases_everything():
    port = free_port()
    exc = _check_released(lambda: StoreClient(master=f"127.0.0.1:{port}",
                                              global_segment_size=64 << 20, timeout=2.0))
    assert f"127.0.0.1:{port}" in str(exc)


def test_store_client_with_a_wrong_token_releases_everything(master):
    _check_released(lambda: StoreClient(master=master, global_segment_size=64 << 20,
                                        token="wrong-" + "x" * 32, timeout=5.0))


def test_engine_whose_metadata_server_is_down_releases_everything():
    port = free_port()
    exc = _check_released(lambda: TransferEngine(metadata=f"http://127.0.0.1:{port}/metadata",
                                                 timeout=2.0))
    assert str(port) in str(exc)


FORGETFUL = """
import os, sys
from kvplane.store import StoreClient
c = StoreClient(master=sys.argv[1], global_segment_size=64 << 20)   # never closed
c.put("k", b"v")
assert c.get("k") == b"v"
print(len([f for f in os.listdir("/dev/shm") if f.startswith("kvplane-%d-" % os.getpid())]))
"""


def test_a_forgotten_clients_shared_memory_goes_with_its_process(master):
    with subprocess.Popen([sys.executable, "-c", FORGETFUL, master], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert int(out.split()[-1]) >= 1, "the client held no shared memory while it ran"
    assert _own_shm(proc.pid) == [], "the exited client's /dev/shm file is still there"
