"""Clients that arrive before the server is ready retry inside their deadline (issue 28).

``kvplane serve`` is spawned on fixed free ports and, at the same moment, 20 Mooncake-API
clients (one thread each) call ``setup()`` against those ports: the first connects are refused
(nothing bound yet), later ones find the metadata server up and the master not yet serving.
Every client must set up, put three checksummed values and read them back. Before the fix
every setup failed at once with "metadata server ...: Connection refused", and a master whose
port was bound before its handlers were added could answer an early mount "unknown method".
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading

import pytest

from kvplane.common.procs import wait_for_line
from kvplane.compat.mooncake import MooncakeDistributedStore
from tests.support.services import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
CLIENTS = 20
SIZES = (4 << 10, 64 << 10, 1 << 20)


def _client(i: int, master: str, metadata: str, barrier: threading.Barrier,
            results: dict[int, str]) -> None:
    store = MooncakeDistributedStore()
    try:
        rc = store.setup("127.0.0.1", metadata, 16 << 20, 16 << 20, "tcp", "", master)
        if rc != 0:
            results[i] = f"setup {rc}"
            return
        for n, size in enumerate(SIZES):
            key, value = f"race-{i}-{n}", os.urandom(size)
            rc = store.put(key, value)
            got = store.get(key)
            if rc != 0 or hashlib.sha256(got).digest() != hashlib.sha256(value).digest():
                results[i] = f"{key}: put {rc}, read {len(got)} of {size} bytes"
                return
        results[i] = "ok"
    finally:
        try:  # a client's segment holds others' replicas: nobody leaves before all are done
            barrier.wait(120)
        except threading.BrokenBarrierError:
            pass
        store.close()


@pytest.mark.parametrize("token_from", ["env", "file"])
def test_twenty_clients_started_with_serve_all_succeed(monkeypatch, tmp_path, token_from):
    """``env``: one token for all in KVPLANE_TOKEN. ``file``: as on a fresh host, no token
    anywhere yet: serve generates the token file once it starts, and clients that looked for
    it before then read it again when the master refuses them (StoreClient)."""
    if token_from == "env":
        monkeypatch.setenv("KVPLANE_TOKEN", "startup-race-" + os.urandom(8).hex())
    else:
        monkeypatch.delenv("KVPLANE_TOKEN", raising=False)
        monkeypatch.setenv("KVPLANE_TOKEN_FILE", str(tmp_path / "kvplane" / "token"))
    master_port, meta_port, admin_port = free_port(), free_port(), free_port()
    master, metadata = f"127.0.0.1:{master_port}", f"http://127.0.0.1:{meta_port}/metadata"
    serve = subprocess.Popen(
        [sys.executable, "-m", "kvplane.cli.main", "serve", "--master-port", str(master_port),
         "--metadata-port", str(meta_port), "--admin-port", str(admin_port),
         "--segment-size", "64MiB"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results: dict[int, str] = {}
    barrier = threading.Barrier(CLIENTS)
    threads = [threading.Thread(target=_client, args=(i, master, metadata, barrier, results))
               for i in range(CLIENTS)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
        ready = wait_for_line(serve.stdout, 30)  # it did come up, on the ports picked
        assert f'"{master}"' in ready, ready
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            err = serve.communicate(timeout=30)[1]
        except subprocess.TimeoutExpired:
            serve.kill()
            err = serve.communicate()[1]
    bad = {i: r for i, r in sorted(results.items()) if r != "ok"}
    assert len(results) == CLIENTS and not bad, (bad, err[-2000:])
