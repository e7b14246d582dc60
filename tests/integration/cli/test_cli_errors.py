"""Each CLI mistake a person makes ends in one line on stderr, the right exit code (2 usage,
1 runtime), and nothing left behind: no /dev/shm file, no process, no traceback (but with --debug).

Real ``kvplane`` processes on 127.0.0.1; "port in use" holds a port in this test process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest

from tests.support.cli_run import CLI, one_line, run, shm_files
from tests.support.services import free_port

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("size", ["abc", "0", "-1"])
def test_bad_segment_size_is_a_usage_error(size):
    res = run(["serve", "--segment-size", size, "--master-port", "0", "--metadata-port", "0",
               "--admin-port", "0"])
    one_line(res, 2, "kvplane serve:", "--segment-size", "--help")
    assert res.stdout == ""


def test_bad_size_of_a_segment_and_a_bad_port_are_usage_errors():
    one_line(run(["segment", "--size", "12 parsecs"]), 2, "kvplane segment:", "--size")
    one_line(run(["metadata", "--port", "70000"]), 2, "kvplane metadata:", "--port")
    one_line(run(["master", "--high-watermark", "1.5", "--port", "0"]), 2, "--high-watermark")


def test_unknown_option_is_a_usage_error():
    one_line(run(["master", "--no-such-flag"]), 2, "kvplane master:", "--no-such-flag")


@pytest.mark.parametrize("cmd", [
    ["metadata", "--port", "{p}"],
    ["master", "--port", "{p}", "--admin-port", "0"],
    ["serve", "--master-port", "0", "--metadata-port", "0", "--admin-port", "{p}",
     "--segment-size", "64MiB"],
    ["conductor", "--port", "{p}"],
])
def test_port_in_use_names_the_holder_and_the_option(cmd):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        res = run([a.format(p=port) for a in cmd])
    line = one_line(res, 1, f"port {port}", "in use", f"pid {os.getpid()}", "or stop it")
    option = cmd[cmd.index("{p}") - 1]
    assert f"pass another {option}" in line


def test_unreachable_master_leaves_no_shared_memory():
    port = free_port()
    res = run(["segment", "--master", f"127.0.0.1:{port}", "--size", "64MiB"])
    one_line(res, 1, "kvplane segment:", f"cannot reach the master at 127.0.0.1:{port}",
             "--master")
    res = run(["client-server", "--master", f"127.0.0.1:{port}", "--size", "64MiB", "--port", "0"])
    one_line(res, 1, "kvplane client-server:", "cannot reach the master")


def test_debug_prints_the_traceback_then_the_line():
    res = run(["--debug", "segment", "--master", f"127.0.0.1:{free_port()}", "--size", "64MiB"])
    assert res.returncode == 1
    assert "Traceback" in res.stderr
    assert res.stderr.splitlines()[-1].startswith("kvplane segment: cannot reach the master")
    res = run(["segment", "--master", f"127.0.0.1:{free_port()}", "--size", "64MiB"],
              KVPLANE_DEBUG="1")
    assert res.returncode == 1 and "Traceback" in res.stderr


@pytest.fixture
def master(tmp_path):
    """A master on port 0 with its own token; yields (address, token)."""
    token = "master-token-" + "a" * 32
    with subprocess.Popen([*CLI, "master", "--port", "0", "--admin-port", "0", "--token", token,
                           "--admin-token", "b" * 40],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as proc:
        try:
            ready = json.loads(proc.stdout.readline())
            assert ready["service"] == "master"
            yield ready["master"], token
        finally:
            proc.terminate()
            proc.wait(20)


def test_bad_token_is_refused_in_one_line(master):
    addr, _ = master
    res = run(["segment", "--master", addr, "--size", "64MiB", "--token", "wrong-" + "c" * 32])
    one_line(res, 1, "kvplane segment:", f"the master at {addr} refused this token", "--token")


def test_the_right_token_starts_the_segment(master):
    """The control: the same command with the master's token gets as far as its ready line."""
    addr, token = master
    with subprocess.Popen([*CLI, "segment", "--master", addr, "--size", "64MiB", "--token", token,
                           "--metrics-port", "-1"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            ready = json.loads(proc.stdout.readline())
            assert ready["service"] == "segment" and ready["size"] == 64 << 20
        finally:
            proc.terminate()
        assert proc.wait(20) == 0, proc.stderr.read()
    assert shm_files(proc.pid) == []


def test_missing_files_are_usage_errors(tmp_path):
    gone = str(tmp_path / "missing.json")
    one_line(run(["master", "--tenants", gone, "--port", "0", "--admin-port", "0"]), 2,
             "kvplane master:", "--tenants", gone)
    one_line(run(["conductor", "--register-file", gone, "--port", "0"]), 2,
             "kvplane conductor:", "--register-file", gone)
    one_line(run(["p2p", "publish", "x", gone, "--tracker", f"http://127.0.0.1:{free_port()}"]), 2,
             "kvplane p2p publish:", gone)


def test_tools_fail_in_one_line_too(tmp_path):
    one_line(run(["simulate", "--trace", str(tmp_path / "none.jsonl")]), 2, "kvplane simulate:",
             "none.jsonl")
    one_line(run(["bench", "transfer", "--sizes", "4KiB,huge"]), 2, "kvplane bench transfer:",
             "'huge'")
    one_line(run(["p2p", "ls", "--tracker", f"http://127.0.0.1:{free_port()}"]), 1,
             "kvplane p2p ls:", "unreachable")


def test_a_host_that_is_not_here_is_a_usage_error():
    one_line(run(["metadata", "--host", "192.0.2.1", "--port", "0"]), 2, "kvplane metadata:",
             "--host", "192.0.2.1 is not an address of this host")
    one_line(run(["segment", "--host", "192.0.2.1", "--size", "64MiB"]), 2, "--host")
