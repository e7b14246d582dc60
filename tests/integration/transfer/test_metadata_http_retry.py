"""The HTTP metadata client retries a server it cannot reach yet (refused, reset, timed out)
until its deadline (issue 28): a client that starts before ``kvplane metadata`` / ``serve``."""

from __future__ import annotations

import threading
import time

import pytest

from kvplane.common.errors import Unavailable
from kvplane.transfer.metadata import HttpMetadata
from kvplane.transfer.metadata_server import serve_in_thread
from tests.support.services import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def test_a_put_before_the_server_is_up_lands_once_it_is():
    port = free_port()
    servers = []
    starter = threading.Timer(0.8, lambda: servers.append(serve_in_thread(port=port)))
    meta = HttpMetadata(f"http://127.0.0.1:{port}/metadata")
    starter.start()
    try:
        meta.put("k", b"v", timeout=10)  # refused for 0.8 s, then served
        assert meta.get("k", timeout=5) == b"v"
    finally:
        starter.join()
        meta.close()
        for s in servers:
            s.close()


def test_no_server_at_all_fails_at_the_deadline_with_the_reason():
    meta = HttpMetadata(f"http://127.0.0.1:{free_port()}/metadata")
    start = time.monotonic()
    with pytest.raises(Unavailable, match="refused.*gave up after 1s"):
        meta.get("k", timeout=1.0)
    assert 0.7 < time.monotonic() - start < 2.5
    meta.close()
