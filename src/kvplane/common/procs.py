"""Child processes that announce readiness: start, wait for a ready line (never sleep), kill, stop.

Owns :class:`Proc` (a child speaking JSON lines on stdin/stdout), :func:`wait_for_line`,
:func:`wait_until` (poll a check with back-off) and :func:`free_port`. Used by ``kvplane bench``
to run the store's processes, and by the test tree's harnesses (``tests/support``). Imports only
``kvplane.common``; nothing here knows a kvplane command line.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from kvplane.common.errors import Timeout


def wait_for_line(stream: IO[str], timeout: float) -> str:
    """Read one line from a pipe within ``timeout`` seconds.

    Raises:
        Timeout: nothing arrived in time. EOFError: the pipe closed.
    """
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise Timeout(f"no line within {timeout}s")
        ready, _, _ = select.select([stream], [], [], left)
        if ready:
            line = stream.readline()
            if not line:
                raise EOFError("process closed its output")
            return line


class Proc:
    """A child process with line-oriented stdin/stdout."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None,
                 ready_timeout: float = 30.0, stop_signal: int | None = None) -> None:
        self.stop_signal = stop_signal  # None: stop by closing stdin; else send this signal
        self.popen = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, bufsize=1,
                                      env={**os.environ, **(env or {})})
        try:
            self.info: dict[str, Any] = json.loads(wait_for_line(self.popen.stdout, ready_timeout))  # type: ignore[arg-type]  # stdout is a PIPE: never None
        except (Timeout, EOFError, ValueError) as exc:
            self.kill()
            err = self.popen.stderr.read() if self.popen.stderr else ""
            self._close_pipes()  # no object survives to close them: left open, a later GC warns
            raise RuntimeError(f"{args} failed to start: {exc}; stderr: {err[-2000:]}") from exc

    @property
    def pid(self) -> int:
        return self.popen.pid

    def ask(self, line: str, timeout: float = 10.0) -> dict[str, Any]:
        """Send a command line and parse the JSON reply."""
        assert self.popen.stdin is not None and self.popen.stdout is not None
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()
        return json.loads(wait_for_line(self.popen.stdout, timeout))  # type: ignore[no-any-return]  # a JSON object by the ready-line protocol

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def kill(self, timeout: float = 60.0) -> None:
        """kill -9 and reap (a host loaded by spinning engines took over 10 s to end one)."""
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Ask for a clean exit (close stdin, or ``stop_signal``), then kill if it lingers."""
        if self.popen.poll() is None:
            try:
                self.popen.send_signal(signal.SIGCONT)
                if self.popen.stdin:
                    self.popen.stdin.close()
                if self.stop_signal is not None:
                    self.popen.send_signal(self.stop_signal)
                self.popen.wait(timeout)
            except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
                self.kill()
        self._close_pipes()

    def _close_pipes(self) -> None:
        for f in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if f:
                try:
                    f.close()
                except (BrokenPipeError, OSError):
                    pass

    def __enter__(self) -> Proc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()



def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``check`` (with a short back-off) until it is true or ``timeout`` passes.

    Raises:
        Timeout: ``check`` stayed false for ``timeout`` seconds (the message names ``what``).
    """
    deadline = time.monotonic() + timeout
    delay = 0.01
    while not check():
        if time.monotonic() > deadline:
            raise Timeout(f"{what} not ready within {timeout}s")
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


_HANDED_OUT: dict[int, None] = {}  # ports free_port returned, oldest first
_HANDED_OUT_MAX = 4096
_HANDED_OUT_LOCK = threading.Lock()


def free_port() -> int:
    """A port that was free a moment ago (for servers that cannot bind port 0 themselves).

    Never the same port twice in one process (of the last 4,096): the kernel may hand a port
    just released to the next ``bind(0)``, so two servers started back to back, neither bound
    yet, would be given the same one. A server binding with SO_REUSEPORT (vLLM's API server
    does) then shares it without an error, and requests land on either.
    """
    with _HANDED_OUT_LOCK:
        for _ in range(64):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if port not in _HANDED_OUT:
                break
        _HANDED_OUT[port] = None
        while len(_HANDED_OUT) > _HANDED_OUT_MAX:
            del _HANDED_OUT[next(iter(_HANDED_OUT))]
        return port
