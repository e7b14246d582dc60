"""Run a ``kvplane`` command as a person would and check what it leaves: its own process
session, then no process of that session and no /dev/shm file of its pid (the CLI tests)."""

from __future__ import annotations

import os
import subprocess
import sys

CLI = [sys.executable, "-m", "kvplane.cli.main"]


def run(args: list[str], timeout: float = 60.0, **env: str) -> subprocess.CompletedProcess:
    """Run ``kvplane ARGS`` in its own session; check that it left no process or shm file."""
    with subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True, env={**os.environ, **env}) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait(10)
    assert group_pids(proc.pid) == [], f"processes left behind: {group_pids(proc.pid)}"
    assert shm_files(proc.pid) == [], f"/dev/shm files left behind: {shm_files(proc.pid)}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def group_pids(pgid: int) -> list[int]:
    """The live (non-zombie) processes of process group ``pgid``."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(pid))
    return pids


def shm_files(pid: int) -> list[str]:
    """The /dev/shm files of kvplane process ``pid``."""
    return [f for f in os.listdir("/dev/shm") if f.startswith(f"kvplane-{pid}-")]


def one_line(res: subprocess.CompletedProcess, code: int, *words: str) -> str:
    """The single stderr line of a failed command, checked for its exit code and words."""
    lines = res.stderr.splitlines()
    assert res.returncode == code, (res.returncode, res.stderr)
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


