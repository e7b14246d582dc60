"""The P2P tests' node processes (tests/integration/p2p): their token, command line and the
JSON lines they speak. Imported by module path, never as ``conftest`` (see engine_checks.py)."""

import json
import sys

from kvplane.common.procs import wait_for_line

TOKEN = "p2p-test-token"


def node_argv(url, *extra):
    return [sys.executable, "-m", "tests.support.p2p_proc", "--tracker", url, "--token", TOKEN,
            *extra]


def send(proc, **cmd):
    proc.popen.stdin.write(json.dumps(cmd) + "\n")
    proc.popen.stdin.flush()


def recv(proc, timeout=60):
    return json.loads(wait_for_line(proc.popen.stdout, timeout))


def ask_all(procs, timeout=60, **cmd):
    """Send ``cmd`` to every process at once, then collect every answer."""
    for p in procs:
        send(p, **cmd)
    return [recv(p, timeout) for p in procs]
