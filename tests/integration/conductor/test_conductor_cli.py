"""The `conductor` CLI command: help text and a real process serving HTTP."""

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import typer
from typer.testing import CliRunner

from kvplane.cli import conductor as cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
LAUNCH = ("import sys, typer\nfrom kvplane.cli import conductor\napp = typer.Typer()\n"
          "conductor.register(app)\n@app.callback()\ndef _root():\n    pass\napp(sys.argv[1:])\n")


def test_help_teaches_vllm_setup():
    app = typer.Typer()
    cli.register(app)
    app.callback()(lambda: None)
    out = CliRunner().invoke(app, ["conductor", "--help"], env={"COLUMNS": "120"})
    assert out.exit_code == 0
    for needle in ("--kv-events-config", "PYTHONHASHSEED", "--bind", "/register", "13333",
                   "replay_endpoint", "--hash-algo", "--token"):
        assert needle in out.output, needle


def _read_line(proc, pattern, timeout):
    """The first stderr line matching ``pattern`` (read in a thread: lines that arrive together
    sit in the pipe's buffer, where select() no longer sees them)."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in iter(proc.stderr.readline, "")],
                     daemon=True).start()
    deadline, seen = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        seen += line
        if m := re.search(pattern, line):
            return m
    raise AssertionError(f"no {pattern!r} within {timeout}s; stderr:\n{seen}")


def test_process_serves_and_loads_registrations(tmp_path):
    regs = tmp_path / "regs.json"
    regs.write_text(json.dumps([{"modelname": "m", "instance_id": "static", "block_size": 16}]))
    env = {**os.environ, "KVPLANE_TOKEN": "tok", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, "conductor", "--port", "0", "--bind", "tcp://127.0.0.1:0",
         "--register-file", str(regs), "--hash-algo", "sha256_cbor"],
        stderr=subprocess.PIPE, text=True, env=env)
    try:
        m = _read_line(proc, r"on (http://127\.0\.0\.1:\d+) \(zmq bind: tcp://127\.0\.0\.1:(\d+)", 30)
        url = m.group(1)  # printed once the HTTP server accepts connections
        r = httpx.get(url + "/instances", headers={"Authorization": "Bearer tok"}, timeout=5)
        (row,) = r.json()
        assert row["instance_id"] == "static" and row["hash_profile"]["algorithm"] == "sha256_cbor"
        assert httpx.get(url + "/instances", timeout=2).status_code == 401  # token from env
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(15)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.stderr.close()
    assert proc.returncode == 0


def test_bad_flags_are_usage_errors():
    app = typer.Typer()
    cli.register(app)
    app.callback()(lambda: None)
    out = CliRunner().invoke(app, ["conductor", "--hash-algo", "md5", "--port", "0"])
    assert out.exit_code == 2 and "md5" in out.output
