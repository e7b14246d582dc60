"""The NIXL-raw side of ``kvplane bench transfer``: two ``nixl_agent`` s (UCX backend) in two
processes, with no kvplane engine between the loop and NIXL.

The target registers a numpy DRAM buffer with its agent and hands its agent metadata to this
process (a pipe), which loads it with ``add_remote_agent`` and registers its own buffer. Each
call is then what a synchronous engine call is: descriptors (``get_xfer_descs``), one request
(``initialize_xfer``) with one descriptor per item (a batch of 32 is one request of 32
descriptors), ``transfer``, a busy poll of ``check_xfer_state`` until DONE, and
``release_xfer_handle``. :class:`RawNixl` gives that Mooncake's four sync calls, so the cells
run in exactly the loop of the other sides (``te_worker.run_cells``).

Both agents are built as kvplane's are (:func:`kvplane.transfer.transports.nixl.new_agent`: the
same progress-thread setting, ``KVPLANE_NIXL_PROGRESS_US``), so the two NIXL sides differ only
by kvplane's engine. NIXL is imported through
:func:`kvplane.transfer.transports.nixl.import_nixl` in both processes: it applies
``avoid_exit_crash`` (``UCX_MODULES=^efa`` where the wheel's EFA module would load the system's
libibverbs) before ``nixl_cu12`` loads. Without it a process that
created a UCX agent dies at exit with SIGSEGV (rc 139). UCX's transports come from the
environment (``UCX_TLS``; unset: UCX's own choice).

    python nixl_worker.py [--label L] [--sizes ...] [--batches ...] [--ops ...] [--buf-mb M]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvplane.bench.te_worker import options, run_cells


def _agent(name: str) -> Any:
    from kvplane.transfer.transports.nixl import import_nixl, new_agent

    agent = new_agent(import_nixl(), name)
    if "UCX" not in agent.backends:
        raise RuntimeError("NIXL has no UCX backend here (check UCX_TLS and the plugins)")
    return agent


def _register(agent: Any, buf: np.ndarray) -> Any:
    return agent.register_memory([(int(buf.ctypes.data), buf.nbytes, 0, "")], "DRAM")


def _target(conn: Connection, nbytes: int) -> None:
    agent = _agent(f"raw-target-{os.getpid()}")
    buf = np.empty(nbytes, np.uint8)
    buf.fill(0x5A)
    reg = _register(agent, buf)
    conn.send((bytes(agent.get_agent_metadata()), int(buf.ctypes.data)))
    conn.recv()
    agent.deregister_memory(reg)


class RawNixl:
    """Mooncake's four sync transfer calls on a bare NIXL agent, one request per call (the
    endpoint argument is ignored: there is one peer)."""

    def __init__(self, agent: Any, peer: str) -> None:
        self.agent = agent
        self.peer = peer

    def _xfer(self, op: str, local: list[int], remote: list[int], lengths: list[int]) -> int:
        ag = self.agent
        loc = np.array([(a, n, 0) for a, n in zip(local, lengths)], dtype=np.uint64)
        rem = np.array([(a, n, 0) for a, n in zip(remote, lengths)], dtype=np.uint64)
        handle = ag.initialize_xfer(op, ag.get_xfer_descs(loc, "DRAM"),
                                    ag.get_xfer_descs(rem, "DRAM"), self.peer)
        try:
            state = ag.transfer(handle)
            while state == "PROC":
                state = ag.check_xfer_state(handle)
            return 0 if state == "DONE" else -1
        finally:
            ag.release_xfer_handle(handle)

    def transfer_sync_write(self, ep: str, lp: int, rp: int, n: int) -> int:
        return self._xfer("WRITE", [lp], [rp], [n])

    def transfer_sync_read(self, ep: str, lp: int, rp: int, n: int) -> int:
        return self._xfer("READ", [lp], [rp], [n])

    def batch_transfer_sync_write(self, ep: str, lps: list[int], rps: list[int],
                                  ns: list[int]) -> int:
        return self._xfer("WRITE", lps, rps, ns)

    def batch_transfer_sync_read(self, ep: str, lps: list[int], rps: list[int],
                                 ns: list[int]) -> int:
        return self._xfer("READ", lps, rps, ns)


def main(argv: list[str] | None = None) -> int:
    """Run the cells against a spawned target; exit status 0 when the bytes verified and the
    target exited cleanly."""
    a = options(__doc__).parse_args(argv)
    label = a.label or "nixl-raw"
    nbytes = a.buf_mb << 20
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, nbytes), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError("target did not start within 60 s")
        md, raddr = parent.recv()
        agent = _agent(f"raw-initiator-{os.getpid()}")
        peer = agent.add_remote_agent(md)
        peer = peer.decode() if isinstance(peer, bytes) else str(peer)
        loc = np.empty(nbytes, np.uint8)
        loc.fill(0xA5)
        reg = _register(agent, loc)
        try:
            ok = run_cells(RawNixl(agent, peer), "", int(loc.ctypes.data), raddr, loc, a, label)
        finally:
            agent.remove_remote_agent(peer)
            agent.deregister_memory(reg)
    finally:
        parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    if proc.exitcode != 0:  # e.g. -11: UCX's crash at exit, which avoid_exit_crash prevents
        print(f"nixl-raw target exited with {proc.exitcode}", file=sys.stderr)
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
