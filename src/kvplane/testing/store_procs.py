"""Spawn store processes (master, segment, client worker) for tests; each waits on readiness.
Also ``tenant_pool``: an in-process master with tenants and one segment client."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from typing import Any

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
