"""``kvplane p2p publish|get|ls|rm`` end to end, against a tracker on 127.0.0.1."""

import json
import os
import subprocess
import sys

import pytest

from kvplane.common.procs import Proc
from tests.support.p2p_nodes import TOKEN

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
CLI = [sys.executable, "-m", "kvplane.cli.main", "p2p"]


def run(*args):
    res = subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=60,
                         env={**os.environ, "KVPLANE_TOKEN": TOKEN})
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def test_publish_get_ls_rm(tracker, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.bin").write_bytes(os.urandom(3 * (1 << 20) + 123))
    (src / "config.json").write_bytes(b'{"layers": 2}')
    (src / "empty").write_bytes(b"")
    pub = Proc(CLI + ["publish", "ckpt/step-1", str(src / "model.bin"), str(src / "config.json"),
                      str(src / "empty"), "--tracker", tracker.url, "--chunk-size", "1MiB"],
               env={"KVPLANE_TOKEN": TOKEN}, stop_signal=15)
    try:
        assert pub.info["version"] == 1 and pub.info["files"] == 3
        out = tmp_path / "out"
        got = json.loads(run("get", "ckpt/step-1", "--out", str(out), "--tracker", tracker.url))
        assert got["version"] == 1 and got["failures"] == {}
        for f in ("model.bin", "config.json", "empty"):
            assert (out / f).read_bytes() == (src / f).read_bytes()
        listed = json.loads(run("ls", "ckpt/", "--json", "--tracker", tracker.url))
        assert listed[0]["name"] == "ckpt/step-1" and listed[0]["versions"][0]["chunks"] == 5
        assert "ckpt/step-1" in run("ls", "--tracker", tracker.url)  # the table form
        run("rm", "ckpt/step-1", "--tracker", tracker.url)
        assert json.loads(run("ls", "--json", "--tracker", tracker.url)) == []
    finally:
        pub.stop()


def test_get_of_unknown_name_fails_with_one_line(tracker, tmp_path):
    res = subprocess.run(CLI + ["get", "nope", "--out", str(tmp_path), "--tracker", tracker.url],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "KVPLANE_TOKEN": TOKEN})
    assert res.returncode == 1, res.stderr
    assert res.stderr.splitlines() == [res.stderr.strip()], res.stderr  # one line, no traceback
    assert res.stderr.startswith("kvplane p2p get: ") and "no object 'nope'" in res.stderr
