"""Every server prints the same ready line: one JSON object on stdout, {"service", "pid", ...},
once it listens; a SIGTERM sent as soon as the line is read stops it cleanly (exit 0)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from kvplane.common.procs import wait_for_line
from tests.support.store_procs import spawn_master

pytestmark = pytest.mark.timeout(120)
CLI = [sys.executable, "-m", "kvplane.cli.main"]


@pytest.fixture(scope="module")
def master():
    with spawn_master() as proc:
        yield proc.info["master"]


def _ready(args: list[str]) -> dict:
    with subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        try:
            line = json.loads(wait_for_line(proc.stdout, 60))
        finally:
            proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
        assert rc in (0, -signal.SIGTERM) if args[0] == "conductor" else rc == 0, \
            (args, rc, proc.stderr.read())
        assert line["pid"] == proc.pid
    return line


@pytest.mark.parametrize("args,keys", [
    (["metadata", "--port", "0"], ["metadata", "p2p_tracker"]),
    (["master", "--port", "0", "--admin-port", "0"], ["master", "admin_port"]),
    (["serve", "--master-port", "0", "--metadata-port", "0", "--admin-port", "0",
      "--segment-size", "32MiB"], ["master", "metadata", "admin", "segment"]),
    (["conductor", "--port", "0"], ["conductor"]),
])
def test_every_server_prints_the_same_ready_line(args, keys):
    line = _ready(args)
    assert line["service"] == args[0]
    for key in keys:
        assert line[key], (key, line)


def test_segment_and_client_server_ready_lines(master):
    seg = _ready(["segment", "--master", master, "--size", "32MiB"])
    assert seg["service"] == "segment" and seg["segment"]
    cs = _ready(["client-server", "--master", master, "--size", "32MiB", "--port", "0"])
    assert cs["service"] == "client-server" and cs["client_server"]
