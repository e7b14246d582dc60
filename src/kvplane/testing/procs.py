"""Real subprocesses for tests: start, wait for a ready line (never sleep), kill, stop, signal."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
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
            self.info: dict[str, Any] = json.loads(wait_for_line(self.popen.stdout, ready_timeout))  # type: ignore[arg-type]
        except (Timeout, EOFError, ValueError) as exc:
            self.kill()
            err = self.popen.stderr.read() if self.popen.stderr else ""
            raise RuntimeError(f"{args} failed to start: {exc}; stderr: {err[-2000:]}") from exc

    @property
    def pid(self) -> int:
        return self.popen.pid

    def ask(self, line: str, timeout: float = 10.0) -> dict[str, Any]:
        """Send a command line and parse the JSON reply."""
        assert self.popen.stdin is not None and self.popen.stdout is not None
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()
        return json.loads(wait_for_line(self.popen.stdout, timeout))  # type: ignore[no-any-return]

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def kill(self) -> None:
        """kill -9 and reap."""
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(10)

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
        for f in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if f:
                try:
                    f.close()
                except (BrokenPipeError, OSError):
                    pass

    def __enter__(self) -> "Proc":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def spawn_target(*args: str, env: dict[str, str] | None = None) -> Proc:
    """Start ``python -m kvplane.testing.target ARGS`` and wait for its ready line."""
    return Proc([sys.executable, "-m", "kvplane.testing.target", *args], env=env)
