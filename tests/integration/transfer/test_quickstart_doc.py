"""docs/transfer.md's two-process quick start runs as written: target.py and initiator.py are
taken from the doc, run as two processes, and the bytes arrive both ways."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

from kvplane.common.procs import wait_for_line

pytestmark = pytest.mark.timeout(90)
DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "transfer.md"


def _snippet(filename: str) -> str:
    marker = r"(?:<!-- illustrative: [^\n]*-->\n)?"  # the docs test's marker, when there
    found = re.search(rf"`{re.escape(filename)}`:\n\n{marker}```python\n(.*?)```", DOC.read_text(),
                      re.S)
    assert found, f"docs/transfer.md has no `{filename}` block"
    return found.group(1)


def test_transfer_quick_start_runs_as_written(tmp_path):
    for name in ("target.py", "initiator.py"):
        (tmp_path / name).write_text(_snippet(name))
    with subprocess.Popen([sys.executable, "target.py"], cwd=tmp_path, stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as target:
        try:
            seg, addr = wait_for_line(target.stdout, 60).split()
            res = subprocess.run([sys.executable, "initiator.py", seg, addr], cwd=tmp_path,
                                 capture_output=True, text=True, timeout=60)
            assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
            target.stdin.write("\n")
            target.stdin.flush()
            assert wait_for_line(target.stdout, 30).strip() == "hello"
        finally:
            target.stdin.close()
            rc = target.wait(30)
        assert rc == 0, target.stderr.read()
