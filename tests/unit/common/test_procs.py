"""kvplane.common.procs: ports never handed out twice, no pipe left open by a failed start."""

import subprocess
import sys
import types

import pytest

from kvplane.common import procs

pytestmark = pytest.mark.timeout(30)


class _Kernel:
    """A stand-in for ``socket.socket`` whose ``bind(0)`` yields ports from a script."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports

    def socket(self) -> "_Kernel._Sock":
        return _Kernel._Sock(self.ports.pop(0))

    class _Sock:
        def __init__(self, port: int) -> None:
            self.port = port

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

        def bind(self, addr) -> None:
            assert addr == ("127.0.0.1", 0)

        def getsockname(self):
            return ("127.0.0.1", self.port)


def test_free_port_skips_a_port_the_kernel_hands_out_again(monkeypatch):
    # Linux may give a just-released port to the next bind(0); two servers started back to back
    # (vLLM binds with SO_REUSEPORT) then share one port and either answers any request.
    monkeypatch.setattr(procs, "socket", types.SimpleNamespace(socket=_Kernel([40001, 40001, 40002,
                                                                                40002, 40001, 40003]).socket))
    monkeypatch.setattr(procs, "_HANDED_OUT", {})
    assert [procs.free_port(), procs.free_port(), procs.free_port()] == [40001, 40002, 40003]


def test_free_port_forgets_the_oldest_past_its_bound(monkeypatch):
    monkeypatch.setattr(procs, "_HANDED_OUT", {})
    monkeypatch.setattr(procs, "_HANDED_OUT_MAX", 3)
    monkeypatch.setattr(procs, "socket", types.SimpleNamespace(socket=_Kernel([1, 2, 3, 4, 1]).socket))
    assert [procs.free_port() for _ in range(5)] == [1, 2, 3, 4, 1]
    assert list(procs._HANDED_OUT) == [3, 4, 1]


def test_free_port_real_ports_are_distinct():
    ports = [procs.free_port() for _ in range(50)]
    assert len(set(ports)) == 50 and all(0 < p < 65536 for p in ports)


def test_failed_start_closes_the_childs_pipes(monkeypatch):
    made: list[subprocess.Popen] = []
    real = subprocess.Popen

    def popen(*a, **kw):
        made.append(real(*a, **kw))
        return made[-1]

    monkeypatch.setattr(procs.subprocess, "Popen", popen)
    code = "import sys; sys.stderr.write('no ready line'); sys.exit(3)"
    with pytest.raises(RuntimeError, match="no ready line"):
        procs.Proc([sys.executable, "-c", code], ready_timeout=20)
    (p,) = made
    assert p.returncode == 3
    # left open, they are closed by a later garbage collection, and pytest reports the
    # ResourceWarnings against whichever test is running then
    assert p.stdin.closed and p.stdout.closed and p.stderr.closed
