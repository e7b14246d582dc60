"""Fixtures for P2P tests: a tracker (the metadata server with /p2p mounted) and node processes."""

import json
import sys

import pytest

from kvplane.common.procs import Proc, wait_for_line
from kvplane.p2p import TrackerClient
from kvplane.p2p.tracker_api import mount
from kvplane.transfer.metadata_server import serve_in_thread

TOKEN = "p2p-test-token"


@pytest.fixture
def tracker():
    srv = serve_in_thread(token=TOKEN, plugins=[mount])
    client = TrackerClient(srv.url, TOKEN)
    yield client
    client.close()
    srv.close()


def node_argv(url, *extra):
    return [sys.executable, "-m", "tests.support.p2p_proc", "--tracker", url, "--token", TOKEN,
            *extra]


@pytest.fixture
def nodes(tracker):
    """``nodes(n, *args)`` starts n node processes; all stopped after the test."""
    started = []

    def make(n, *extra):
        out = [Proc(node_argv(tracker.url, *extra)) for _ in range(n)]
        started.extend(out)
        return out

    yield make
    for p in started:
        p.stop()


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
