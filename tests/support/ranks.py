"""RankGroup: run one function per rank in forked processes around a TCPStore.

A separate process hosts the store, so any worker may be killed (``kill -9``) or stopped without taking
the rendezvous with it. Workers report progress and results over pipes; every wait has a deadline
and a dead worker shows up as an error, never a hang. Binds 127.0.0.1 only (port 0).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.distributed as dist

from kvplane.common.errors import Timeout, Unavailable


@dataclass
class RankContext:
    """What a worker function receives.

    Attributes:
        rank: the worker's slot.
        world_size: number of slots.
        store: a TCPStore client connected to the group's store.
        conn: pipe to the parent; use :meth:`report` rather than writing directly.
    """

    rank: int
    world_size: int
    store: dist.Store
    conn: Connection

    def report(self, what: str, value: Any = None) -> None:
        """Send a progress event (``what``, ``value``) to the parent."""
        self.conn.send_bytes(pickle.dumps(("event", self.rank, what, value)))

    def command(self, timeout: float) -> Any:
        """Wait for a command from the parent.

        Raises:
            Timeout: nothing arrived in time.
        """
        if not self.conn.poll(timeout):
            raise Timeout("no command from the parent")
        return self.conn.recv()


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
           conn: Connection, store_timeout: float) -> None:
    try:
        import torch

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                              timeout=timedelta(seconds=store_timeout))
        value = fn(RankContext(rank, world, store, conn), *args)
        # plain pickle: multiprocessing's pickler would share tensor storage with a dying process
        conn.send_bytes(pickle.dumps(("result", rank, "ok", value)))
    except BaseException:  # reported to the parent, which decides
        conn.send_bytes(pickle.dumps(("result", rank, "error", traceback.format_exc())))
    finally:
        conn.close()


def _serve_store(conn: Connection, timeout: float) -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=timeout),
                          wait_for_workers=False)
    conn.send(store.port)
    try:
        conn.recv()  # the parent's stop message (or EOF)
    except EOFError:
        pass
    os._exit(0)


class RankGroup:
    """Forked rank processes plus the store they meet at (a context manager).

    Args:
        world_size: number of slots.
        store_timeout: default timeout of store operations in the workers.
    """

    def __init__(self, world_size: int, store_timeout: float = 30.0) -> None:
        self.world_size = world_size
        self.store_timeout = store_timeout
        # The store lives in its own forked process: forking workers from a process that runs the
        # store's server thread can deadlock them, and a worker may die with the store otherwise.
        self._ctx = mp.get_context("fork")
        self._store_conn, child = self._ctx.Pipe()
        self._store_proc = self._ctx.Process(target=_serve_store, args=(child, store_timeout),
                                             name="store", daemon=True)
        self._store_proc.start()
        child.close()
        if not self._store_conn.poll(store_timeout):
            self._store_proc.kill()
            raise Timeout("store process did not start")
        self.port: int = self._store_conn.recv()
        self.procs: dict[int, mp.process.BaseProcess] = {}
        self.conns: dict[int, Connection] = {}
        self.results: dict[int, tuple[str, Any]] = {}
        self.events: list[tuple[int, str, Any, float]] = []

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, fn: Callable[..., Any], *args: Any, ranks: list[int] | None = None) -> None:
        """Start ``fn(ctx, *args)`` on ``ranks`` (default: every slot; a running slot is replaced)."""
        for r in range(self.world_size) if ranks is None else ranks:
            parent, child = self._ctx.Pipe()
            p = self._ctx.Process(target=_entry, name=f"rank{r}", daemon=True,
                                  args=(r, self.world_size, self.port, fn, args, child, self.store_timeout))
            p.start()
            child.close()
            self.procs[r], self.conns[r] = p, parent
            self.results.pop(r, None)

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the worker of ``rank`` (only processes this group started)."""
        p = self.procs[rank]
        if p.pid is not None and p.exitcode is None:
            os.kill(p.pid, sig)

    def _drain(self, timeout: float) -> None:
        ready = wait([c for r, c in self.conns.items() if r not in self.results], timeout)
        for c in ready:
            rank = next(r for r, x in self.conns.items() if x is c)
            try:
                kind, r, what, value = pickle.loads(c.recv_bytes())
            except (EOFError, OSError):
                self.results[rank] = ("error", f"rank {rank} exited without a result "
                                               f"(exit code {self.procs[rank].exitcode})")
                continue
            if kind == "event":
                self.events.append((r, what, value, time.monotonic()))
            else:
                self.results[r] = (what, value)

    def wait_event(self, rank: int, what: str, timeout: float, value: Any = None) -> Any:
        """Wait for event ``what`` (with ``value``, if given) from ``rank`` and return its value.

        Raises:
            Timeout: it did not arrive in time.
            Unavailable: the rank finished without sending it.
        """
        deadline = time.monotonic() + timeout
        while True:
            for r, w, v, _ in self.events:
                if r == rank and w == what and (value is None or v == value):
                    return v
            if rank in self.results:
                raise Unavailable(f"rank {rank} finished without {what!r}: {self.results[rank]}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout(f"rank {rank} did not report {what!r}")
            self._drain(left)

    def send(self, rank: int, value: Any) -> None:
        """Send a command to a worker (see :meth:`RankContext.command`)."""
        self.conns[rank].send(value)

    def wait_results(self, ranks: list[int], timeout: float) -> dict[int, Any]:
        """Wait for the results of ``ranks``; raise if any failed.

        Raises:
            Timeout: some rank did not finish in time.
            RuntimeError: a worker raised (its traceback is in the message).
        """
        deadline = time.monotonic() + timeout
        while any(r not in self.results for r in ranks):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in ranks if r not in self.results]
                raise Timeout(f"ranks {missing} did not finish in {timeout}s")
            self._drain(left)
        errors = {r: self.results[r][1] for r in ranks if self.results[r][0] != "ok"}
        if errors:
            raise RuntimeError("worker failures:\n"
                               + "\n".join(f"[rank {r}]\n{e}" for r, e in errors.items()))
        return {r: self.results[r][1] for r in ranks}

    def close(self) -> None:
        """Kill every worker still running, reap them and stop the store (idempotent)."""
        for p in self.procs.values():
            if p.exitcode is None and p.pid is not None:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs.values():
            p.join(timeout=5.0)
        for c in self.conns.values():
            c.close()
        self.procs.clear()
        self.conns.clear()
        if self._store_proc.exitcode is None:
            try:
                self._store_conn.send(None)
            except OSError:
                pass
            self._store_conn.close()
            self._store_proc.join(timeout=5.0)
            if self._store_proc.exitcode is None:
                self._store_proc.kill()
                self._store_proc.join(timeout=5.0)
