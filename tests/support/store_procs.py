"""Spawn store processes (master, segment, client worker) for tests; each waits on readiness.
Also ``tenant_pool``: an in-process master with tenants and one segment client."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
from collections.abc import Iterator
from typing import Any

from kvplane.bench.services import CLI, spawn_master, spawn_segment
from kvplane.common.procs import Proc

__all__ = ["segment_pool", "spawn_client_server", "spawn_master", "spawn_segment", "spawn_worker",
           "tenant_pool"]

def spawn_worker(master: str, *args: str) -> Proc:
    """A store client process answering JSON commands (see tests/support/store_client_proc.py)."""
    return Proc([sys.executable, "-m", "tests.support.store_client_proc", "--master", master, *args])


def not_read_back(worker: Proc, keys: dict[str, int] | list[str], timeout: float = 60) -> dict[str, str]:
    """Ask a worker to read ``keys`` back (checksummed): the keys that did not come back
    intact, with what it found instead ("missing", "corrupt", an error)."""
    verdict = worker.ask(json.dumps({"op": "check", "keys": keys}), timeout)["result"]
    return {k: v for k, v in verdict.items() if v != "ok"}


def spawn_client_server(master: str, size: str = "64MiB", *args: str) -> Proc:
    """``kvplane client-server`` on a free port: ``.info["client_server"]`` is its address."""
    return Proc([*CLI, "client-server", "--master", master, "--port", "0", "--size", size, *args],
                stop_signal=signal.SIGTERM)


@contextlib.contextmanager
def tenant_pool(service_token: str, tenants: dict[str, str],
                **master_kw: Any) -> Iterator[tuple[Any, str, Any]]:
    """An in-process master with tenant tokens and one segment client holding 8 MiB (it accepts
    the tenants' tokens on its data listener); yields (master, its address, the segment client)."""
    from kvplane.store import MasterServer, StoreClient

    with MasterServer(token=service_token, tenants=tenants, **master_kw) as m:
        addr = f"127.0.0.1:{m.port}"
        with StoreClient(master=addr, token=service_token, global_segment_size=8 << 20,
                         peer_tokens=tuple(tenants.values())) as seg:
            yield m, addr, seg


@contextlib.contextmanager
def segment_pool(segments: int = 2, size: str = "64MiB") -> Iterator[tuple[str, list[Proc]]]:
    """A master with ``segments`` segment processes; yields (master address, segments)."""
    with spawn_master() as m, contextlib.ExitStack() as stack:
        addr = m.info["master"]
        yield addr, [stack.enter_context(spawn_segment(addr, size)) for _ in range(segments)]
