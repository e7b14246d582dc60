"""Docs that run: every shell and Python block of README.md and docs/*.md runs as written, in
order, one session per doc, or is marked illustrative (the convention: tests/docs/markdown.py;
how a session runs: tests/docs/shell.py). A block that fails, a block that is neither run nor
marked, an expected output that was not printed, or a /dev/shm file left behind fails here."""

from __future__ import annotations

import os
import pathlib

import pytest

from kvplane.testing.needs import missing
from tests.docs import markdown
from tests.docs.shell import Session, netns_prefix

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]
DOCS = markdown.docs()


def _ids(path: pathlib.Path) -> str:
    return str(path.relative_to(markdown.ROOT))


@pytest.fixture(scope="module")
def netns() -> list[str]:
    words = netns_prefix()
    if words is None:
        missing("a private network namespace (unshare --net, as root or with user namespaces)",
                "run as root, or enable unprivileged user namespaces; apt-get install util-linux")
    return words


def test_every_code_block_is_run_or_marked_illustrative():
    """Parsing enforces the convention (an untagged command block, a text block that looks
    like code, a marker with no reason or in the wrong place, a reason naming a missing test)."""
    run = marked = 0
    for path in DOCS:
        r, m = markdown.counts(markdown.parse(path))
        run, marked = run + r, marked + m
    assert run >= 15, f"only {run} doc blocks run"  # 15 when this test was written


def _runs_something(path: pathlib.Path) -> bool:
    try:
        return any(b.runs for b in markdown.parse(path))
    except markdown.DocError:
        return True  # its test reports the error


@pytest.mark.parametrize("path", [p for p in DOCS if _runs_something(p)], ids=_ids)
def test_doc_runs_as_written(path: pathlib.Path, tmp_path: pathlib.Path, netns: list[str]):
    blocks = markdown.parse(path)
    session = Session(_ids(path), tmp_path, netns)
    try:
        last = None
        for block in blocks:
            if block.runs:
                last = session.run(block)
            elif block.output and last is not None:
                lacking = markdown.missing_output(block, last.output)
                assert lacking is None, (
                    f"{block.where}: the expected output's line /{lacking}/ is not in what "
                    f"{last.block.where} printed:\n{last.output[-3000:]}")
    finally:
        left = session.close()
    assert left == [], f"{_ids(path)} left files in /dev/shm: {left}"


# -- the convention itself ---------------------------------------------------------------------
def _doc(tmp_path: pathlib.Path, text: str) -> pathlib.Path:
    path = tmp_path / "doc.md"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, complaint", [
    ("```\nkvplane serve\n```\n", None),  # untagged command: shell, runs
    ("```text\nkvplane serve\n```\n", "tag it bash"),
    ("<!-- illustrative: -->\n```bash\nx\n```\n", "needs a reason"),
    ("<!-- illustrative: GPU -->\n\n```bash\nx\n```\n", "right before"),
    ("<!-- illustrative: run by tests/nowhere/test_x.py -->\n```bash\nx\n```\n", "does not exist"),
    ("<!-- illustrative: output -->\n```text\nok\n```\n", "only shell and Python"),
    ("<!-- output -->\n```bash\nls\n```\n", "a text block"),
    ("```bash\nx\n", "never closed"),
])
def test_the_convention_is_enforced(tmp_path, text, complaint):
    path = _doc(tmp_path, text)
    if complaint is None:
        [block] = markdown.parse(path)
        assert block.kind == "shell" and block.runs
        return
    with pytest.raises(markdown.DocError, match=complaint):
        markdown.parse(path)


def test_blocks_are_classified_and_counted(tmp_path):
    path = _doc(tmp_path, "\n".join([
        "<!-- setup: kvplane serve -->", "```python", "print(1)", "```",
        "<!-- illustrative: needs vLLM -->", "```bash", "vllm serve x", "```",
        "```", "ingest: 10/s", "```", "  ```", "  from kvplane import x", "  ```",
        "```yaml", "a: 1", "```"]) + "\n")
    blocks = markdown.parse(path)
    assert [b.kind for b in blocks] == ["setup", "python", "shell", "data", "python", "data"]
    assert blocks[2].illustrative == "needs vLLM" and not blocks[2].runs
    assert blocks[4].text == "from kvplane import x\n"
    assert markdown.counts(blocks) == (2, 1)


def test_expected_output_matches_lines_in_order(tmp_path):
    path = _doc(tmp_path, "```bash\nx\n```\n<!-- output -->\n```text\na ... c\nlast\n```\n")
    out = markdown.parse(path)[1]
    assert out.output
    assert markdown.missing_output(out, "noise\na b c\nmore\nlast\n") is None
    assert markdown.missing_output(out, "last\na b c\n") is not None  # out of order
    assert markdown.missing_output(out, "a b\nlast\n") is not None


@pytest.mark.parametrize("text, fails", [("true\n", False), ("false\necho never\n", True)])
def test_a_failing_command_fails_its_block(tmp_path, netns, text, fails):
    path = _doc(tmp_path, f"```bash\n{text}```\n")
    session = Session("doc.md", tmp_path / "s", netns)
    try:
        if fails:
            with pytest.raises(AssertionError, match=r"doc.md:1 \(shell block\) failed \(exit 1\)"):
                session.run(markdown.parse(path)[0])
            assert "never" not in session._output(0)
        else:
            session.run(markdown.parse(path)[0])
    finally:
        assert session.close() == []


def test_a_server_is_left_running_after_its_ready_line(tmp_path, netns):
    """`kvplane metadata &` returns once its ready line is out; the next block reaches it on
    the doc's fixed port, inside the session's own namespace; close() stops it."""
    path = _doc(tmp_path, "```bash\nkvplane metadata --port 8080 &   # ready line\n```\n"
                "```bash\ncurl -sf http://127.0.0.1:8080/health\n```\n")
    session = Session("doc.md", tmp_path / "s", netns)
    try:
        first, second = markdown.parse(path)
        assert '"service": "metadata"' in session.run(first).output
        assert "ok" in session.run(second).output.lower()
        pids = (tmp_path / "s" / ".pids").read_text().split()
    finally:
        assert session.close() == []
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}"), f"pid {pid} still runs"
