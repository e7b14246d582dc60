"""Busy-polling for a reply is for spare CPUs only: a process that may run on one CPU never
polls, since the poll holds the CPU its peer needs to answer (docs/benchmarks.md, issue 32:
pinned to one CPU a cold get took 195 us with polling and 91 us without)."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

PROBE = ("from kvplane.common import sockets, rpc; from kvplane.transfer import server; "
         "import inspect; print(sockets.usable_cpus(), sockets.SPIN_SECONDS, server.SERVER_SPIN, "
         "inspect.signature(rpc.RpcClient).parameters['spin'].default)")


def _probe(cpus: set[int]) -> list[float]:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=50,
                         preexec_fn=lambda: os.sched_setaffinity(0, cpus), check=True)
    return [float(x) for x in out.stdout.split()]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_no_busy_poll_on_one_cpu():
    cpus, client_spin, server_spin, rpc_spin = _probe({min(os.sched_getaffinity(0))})
    assert cpus == 1
    assert client_spin == server_spin == rpc_spin == 0.0


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs 2 CPUs and CPU affinity")
def test_busy_poll_with_spare_cpus():
    cpus, client_spin, server_spin, rpc_spin = _probe(set(sorted(os.sched_getaffinity(0))[:2]))
    assert cpus == 2
    assert client_spin == rpc_spin == 200e-6 and server_spin == 100e-6
