"""One doc's session: its run blocks, in order, in one bash in a private network namespace.

How a block runs (markdown.py says which blocks do):

* The session is one ``bash`` (``set -eo pipefail``) in a new network namespace (``unshare
  --net``; ``--user --map-root-user`` too when not root), so the docs' fixed ports (50051, 8080,
  9003, 13333, 5557 ...) are free and runs never collide. Its working directory is a fresh
  directory; ``HOME`` and ``XDG_RUNTIME_DIR`` are fresh too, so the token file is a new one, as
  on a newcomer's machine. No ``KVPLANE_*`` variable is inherited (``KVPLANE_NIXL=off``, as in
  the rest of the suite). ``python`` is this interpreter.
* A shell block is sourced by that bash: variables and ``cd`` carry over to the next block, and
  the first failing command fails the block (its exit code, the command and the output tail).
* A Python block is written to ``DOC-L<line>.py`` in that directory and run there by this
  interpreter, in a process of its own.
* ``kvplane`` is a shell function: it runs the CLI and returns its exit code and output; a
  command that prints a ready line (``{"service": ...}``: serve, master, segment, conductor,
  router, metadata, ``p2p publish`` ...) is left running in the background once that line is
  out, as a reader moves on to the next command once a server is up. A trailing ``&`` on such a
  line is dropped (the function backgrounds it itself, after its ready line).
* ``pip install ...`` prints one line and does nothing: the suite runs in the environment that
  is already installed (tests/integration/test_readme_fresh_venv.py runs the README's installs).
* At the end every process of the session gets SIGTERM (then SIGKILL), and no ``/dev/shm`` file
  of any of its kvplane processes may be left.
"""

from __future__ import annotations

import os
import pathlib
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from tests.docs.markdown import Block

BLOCK_TIMEOUT = 120.0
READY_TIMEOUT = 60
_KVPLANE_START = re.compile(r"^\s*(?:[A-Z_][A-Z0-9_]*=\S*\s+)*kvplane\s")
_TRAILING_AMP = re.compile(r"(?<=\s)&(\s*#.*)?$")

PRELUDE = r"""
set -eo pipefail
trap 'echo "docs harness: exit $? at line $LINENO of ${BASH_SOURCE[0]##*/}" >&2' ERR
kvplane() {
  local out pid rc=0 deadline=$((SECONDS + KVDOC_READY_TIMEOUT))
  out=$(mktemp "$KVDOC_DIR/.kvplane.XXXXXX")
  "$KVDOC_PYTHON" -m kvplane.cli.main "$@" >"$out" &
  pid=$!
  echo "$pid" >>"$KVDOC_DIR/.pids"
  while kill -0 "$pid" 2>/dev/null; do
    if grep -q '^{"service"' "$out"; then cat "$out"; return 0; fi
    if (( SECONDS >= deadline )); then
      echo "docs harness: 'kvplane $*' printed no ready line within ${KVDOC_READY_TIMEOUT}s" >&2
      return 124
    fi
    sleep 0.05
  done
  wait "$pid" || rc=$?
  cat "$out"
  rm -f "$out"
  return "$rc"
}
pip() { echo "docs harness: 'pip $*' skipped (this environment is installed already)"; }
__kvdoc_python() {
  local pid rc=0
  "$KVDOC_PYTHON" "$1" &
  pid=$!
  echo "$pid" >>"$KVDOC_DIR/.pids"
  wait "$pid" || rc=$?
  return "$rc"
}
__kvdoc_done() { echo "$1" >&"$KVDOC_STATUS_FD"; }
"""

_UP_LOOPBACK = ("import fcntl, socket, struct; s = socket.socket(); "
                "f = struct.unpack('16sH', fcntl.ioctl(s, 0x8913, struct.pack('16sH', b'lo', 0)))[1]; "
                "fcntl.ioctl(s, 0x8914, struct.pack('16sH', b'lo', f | 1))")


class BlockFailed(AssertionError):
    """A run block failed, timed out or printed less than its expected output."""


def netns_prefix() -> list[str] | None:
    """The ``unshare`` words that put a command in a new network namespace, or None."""
    if shutil.which("unshare") is None:
        return None
    words = ["unshare", "--net"] if os.geteuid() == 0 else \
        ["unshare", "--user", "--map-root-user", "--net"]
    probe = subprocess.run([*words, "--", sys.executable, "-c", _UP_LOOPBACK],
                           capture_output=True, timeout=30)
    return words if probe.returncode == 0 else None


def shell_text(block: Block) -> str:
    """A shell block as the session sources it: the trailing ``&`` of a command that starts
    with ``kvplane`` is dropped (the function backgrounds a server itself, after its ready
    line); every other character, and so every line number, stays."""
    out, starts_kvplane, continued = [], False, False
    for line in block.text.splitlines():
        if not continued:
            starts_kvplane = bool(_KVPLANE_START.match(line))
        continued = line.rstrip().endswith("\\")
        if starts_kvplane and not continued:
            line = _TRAILING_AMP.sub(lambda m: m[1] or "", line)
        out.append(line + "\n")
    return "".join(out)


@dataclass
class Result:
    """What one run block printed."""

    block: Block
    output: str


class Session:
    """A bash in its own network namespace that runs one doc's blocks in order."""

    def __init__(self, doc: str, workdir: pathlib.Path, netns: list[str]) -> None:
        self.doc = doc
        self.dir = workdir
        for sub in ("home", "run", "bin"):
            (workdir / sub).mkdir(mode=0o700, parents=True)
        for name in ("python", "python3"):
            (workdir / "bin" / name).symlink_to(sys.executable)
        self.log_path = workdir / ".session.log"
        self._log = open(self.log_path, "ab")
        self._status_r, status_w = os.pipe()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPLANE_", "KVDOC_"))}
        env.update(HOME=str(workdir / "home"), XDG_RUNTIME_DIR=str(workdir / "run"),
                   PATH=f"{workdir / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
                   KVPLANE_NIXL="off", KVDOC_DIR=str(workdir), KVDOC_PYTHON=sys.executable,
                   KVDOC_STATUS_FD=str(status_w), KVDOC_READY_TIMEOUT=str(READY_TIMEOUT),
                   PYTHONUNBUFFERED="1", COLUMNS="160")
        (workdir / ".prelude.sh").write_text(PRELUDE)
        self.proc = subprocess.Popen(
            [*netns, "--", "bash", "--noprofile", "--norc", "-s"], cwd=workdir, env=env,
            stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT,
            pass_fds=(status_w,), start_new_session=True)
        os.close(status_w)
        self._send(f'"$KVDOC_PYTHON" -c "{_UP_LOOPBACK}"\nsource .prelude.sh\n')
        self._pending = b""
        self.ran: list[Result] = []

    def _send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text.encode())
        self.proc.stdin.flush()

    def run(self, block: Block, timeout: float = BLOCK_TIMEOUT) -> Result:
        """Run one block (a shell or Python block, or a setup command); its output.

        Raises:
            BlockFailed: it exited non-zero, the session died, or it ran past ``timeout``.
        """
        n = len(self.ran)
        tag = pathlib.Path(block.doc).name + f"-L{block.line}"
        if block.kind == "python":
            (self.dir / f"{tag}.py").write_text(block.text)
            command = f'__kvdoc_python "$KVDOC_DIR/{tag}.py"'
        else:
            (self.dir / f"{tag}.sh").write_text(shell_text(block))
            command = f'source "$KVDOC_DIR/{tag}.sh" </dev/null'
        start = self.log_path.stat().st_size
        self._send(f"{command}\n__kvdoc_done {n}\n")
        self._wait_done(n, block, start, timeout)
        result = Result(block, self._output(start))
        self.ran.append(result)
        return result

    def _wait_done(self, n: int, block: Block, start: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self._pending.split(b"\n").count(str(n).encode()):
                self._pending = b""
                return
            if self.proc.poll() is not None:
                raise self._failure(block, start, f"failed (exit {self.proc.returncode})")
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._failure(block, start, f"did not finish within {timeout:.0f} s")
            ready, _, _ = select.select([self._status_r], [], [], min(left, 0.2))
            if ready:
                self._pending += os.read(self._status_r, 4096)

    def _output(self, start: int) -> str:
        self._log.flush()
        with open(self.log_path, "rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace")

    def _failure(self, block: Block, start: int, what: str) -> BlockFailed:
        tail = self._output(start)[-4000:]
        return BlockFailed(f"{block.where} ({block.kind} block) {what}.\n--- block ---\n"
                           f"{block.text}--- output (tail) ---\n{tail}")

    def close(self, grace: float = 15.0) -> list[str]:
        """Stop every process of the session (SIGTERM, then SIGKILL after ``grace``); the
        ``/dev/shm`` files its kvplane processes left behind (which should be none)."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _group_alive(self.proc):
            time.sleep(0.05)  # polling the process group's exit, with a deadline
        if _group_alive(self.proc):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        os.close(self._status_r)
        self._log.close()
        return self.leftovers()

    def leftovers(self) -> list[str]:
        pids_file = self.dir / ".pids"
        pids = set(pids_file.read_text().split()) if pids_file.exists() else set()
        return sorted(f for f in os.listdir("/dev/shm")
                      if f.startswith("kvplane-") and f.split("-")[1] in pids)


def _group_alive(proc: subprocess.Popen[bytes]) -> bool:
    """Whether any process of ``proc``'s group runs (``proc`` itself is reaped first: a zombie
    still counts as a member)."""
    proc.poll()
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    return True
