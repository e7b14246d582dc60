"""Fixtures for P2P tests: a tracker (the metadata server with /p2p mounted) and node processes."""

import pytest

from kvplane.common.procs import Proc
from kvplane.p2p import TrackerClient
from kvplane.p2p.tracker_api import mount
from kvplane.transfer.metadata_server import serve_in_thread
from tests.support.p2p_nodes import TOKEN, node_argv


@pytest.fixture
def tracker():
    srv = serve_in_thread(token=TOKEN, plugins=[mount])
    client = TrackerClient(srv.url, TOKEN)
    yield client
    client.close()
    srv.close()


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
