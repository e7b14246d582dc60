"""Every command the README shows runs as shown (ports 0 instead of the fixed defaults, so tests
can run side by side): `kvplane serve` and its ready line, the client snippet against it (which
must leave no /dev/shm file), the Mooncake import line, and `kvplane COMMAND --help` for every
command it lists. The two install commands run in tests/integration/test_readme_fresh_venv.py."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from kvplane.common.procs import wait_for_line

pytestmark = pytest.mark.timeout(180)
README = (pathlib.Path(__file__).resolve().parents[3] / "README.md").read_text(encoding="utf-8")
CLI = [sys.executable, "-m", "kvplane.cli.main"]


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def test_readme_shows_the_commands_this_file_runs():
    bash = _blocks("bash")
    assert any("pip install -e . && kvplane serve" in b for b in bash)
    assert any("pip install -e '.[dev]' && python -m pytest -q" in b for b in bash)
    assert len(_blocks("python")) == 1


@pytest.fixture(scope="module")
def served():
    """`kvplane serve` as the README runs it, on free ports."""
    with subprocess.Popen([*CLI, "serve", "--master-port", "0", "--metadata-port", "0",
                           "--admin-port", "0", "--segment-size", "64MiB"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            ready = json.loads(wait_for_line(proc.stdout, 60))
            yield ready, proc
        finally:
            proc.terminate()
            proc.wait(30)


def test_serve_prints_its_addresses_and_where_the_token_is(served):
    ready, proc = served
    for key in ("master", "metadata", "admin", "segment"):
        assert ready[key], key
    note = proc.stderr.readline()  # the held notes come out before the ready line
    assert "token" in note and os.environ["KVPLANE_TOKEN_FILE"] in note


def test_readme_client_snippet_runs_and_cleans_up(served):
    ready, _ = served
    code = _blocks("python")[0].replace("127.0.0.1:50051", ready["master"])
    assert ready["master"] in code
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert [f for f in os.listdir("/dev/shm") if f.startswith(f"kvplane-{proc.pid}-")] == []


def test_mooncake_import_line_runs():
    line = re.search(r"`(from kvplane\.compat\.mooncake import [^`]+)`", README).group(1)
    res = subprocess.run([sys.executable, "-c", line], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


def test_every_listed_command_explains_itself():
    listed = re.search(r"Commands: `kvplane ([^`]+)`", README).group(1).split(" | ")
    assert "serve" in listed and len(listed) >= 10
    for cmd in listed:
        res = subprocess.run([*CLI, cmd, "--help"], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "COLUMNS": "120"})
        assert res.returncode == 0 and "Usage: kvplane " + cmd in " ".join(res.stdout.split()), \
            (cmd, res.stderr)
