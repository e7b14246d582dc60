"""The fenced blocks of README.md and docs/*.md, and what the docs test does with each.

This docstring is the one place that states the convention (README's "Docs" section points here).

Every fenced block is one of:

* **shell** (```` ```bash ````, ``sh``, ``shell``, ``console``) and **python** (```` ```python ````):
  run by tests/docs/test_docs.py, in document order, one session per doc (shell.py says how);
* **illustrative**: a shell or Python block that cannot run here, marked on the line right
  before its opening fence with ``<!-- illustrative: REASON -->`` (a vLLM or GPU run, several
  hosts, a benchmark of minutes, a fragment). The reason is required. When another test runs the
  block, the reason names it (``run by tests/...py``) and that file must exist;
* **data**: anything else (```` ```text ```` for output, diagrams and trees; ``json``, ``yaml``).

A block without a language is classified by its first line: a command (``kvplane``, ``python``,
``curl``, ``VAR=value cmd`` ...) makes it shell, an ``import`` makes it Python, anything else is
data. A ``text`` block that starts like a command fails: tag it ``bash``. So a block that looks
like code is either run or marked, never silently neither.

Two more comments steer a doc's session (neither is a block; put them on their own line):

* ``<!-- setup: COMMAND -->`` runs COMMAND in the session at that point, for what the prose
  says is already running (``<!-- setup: kvplane serve -->`` where a page says "with
  ``kvplane serve`` running");
* ``<!-- output -->`` on the line before a ```` ```text ```` block makes that block the expected
  output of the nearest run block above it: each of its lines must match one line of what that
  block printed, in order (``...`` matches anything; leading and trailing blanks are ignored).

``python -m tests.docs.markdown`` prints, per doc, how many blocks run and how many are marked.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import sys
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHELL = frozenset({"bash", "sh", "shell", "console"})
PYTHON = frozenset({"python", "py", "python3"})
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,})(?P<lang>[\w+-]*)[^`]*$")
MARK = re.compile(r"^\s*<!--\s*(?P<what>illustrative|setup|output)\s*(?::\s*(?P<arg>.*?))?\s*-->\s*$")
# the first word of a line that is a command a reader would type
COMMANDS = ("kvplane", "python", "python3", "pip", "curl", "export", "cd", "bash", "sh", "etcd",
            "for", "install", "openssl", "kubectl", "docker", "git", "sudo", "uv", "pytest",
            "wget", "mkdir", "cat", "ls", "rm", "cp", "echo", "vllm")
_WORDS = "|".join(map(re.escape, COMMANDS))
COMMAND = re.compile(rf"^(\$ )?([A-Z_][A-Z0-9_]*=\S*\s+)*({_WORDS})(\s|$)")
PY_START = re.compile(r"^(from \S+ import |import \S+|with \S+\(|\"\"\")")


class DocError(Exception):
    """A doc breaks the convention (the message names the file and line)."""


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block (or a setup comment) of a doc."""

    doc: str          # path relative to the repo root
    line: int         # 1-based line of the opening fence (of the comment, for setup)
    lang: str         # the info string's first word ("" when none)
    kind: str         # "shell", "python", "data" or "setup"
    text: str         # the body, dedented by the fence's indent
    illustrative: str | None = None  # the marker's reason
    output: bool = False             # a data block marked <!-- output -->

    @property
    def runs(self) -> bool:
        """Run by the docs test (a setup comment runs too, but is not a block)."""
        return self.kind in ("shell", "python", "setup") and self.illustrative is None

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def docs() -> list[pathlib.Path]:
    """README.md and every docs/*.md, in a stable order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def classify(lang: str, text: str) -> str:
    """"shell", "python" or "data" for a block with info string ``lang`` and body ``text``."""
    if lang in SHELL:
        return "shell"
    if lang in PYTHON:
        return "python"
    if lang not in ("", "text"):
        return "data"
    first = next((ln.strip() for ln in text.splitlines()
                  if ln.strip() and not ln.strip().startswith("#")), "")
    if COMMAND.match(first):
        return "shell"
    if PY_START.match(first):
        return "python"
    return "data"


def parse(path: pathlib.Path) -> list[Block]:
    """The blocks and setup comments of one doc, in order.

    Raises:
        DocError: an unclosed fence, a marker with no reason, a marker not followed by a fence,
            a ``text`` block that looks like commands, or a marker on a data block.
    """
    rel = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    pending: tuple[str, str | None, int] | None = None  # a marker waiting for its fence
    i = 0
    while i < len(lines):
        mark, fence = MARK.match(lines[i]), FENCE.match(lines[i])
        if mark and mark["what"] == "setup":
            if not mark["arg"]:
                raise DocError(f"{rel}:{i + 1}: <!-- setup: COMMAND --> needs a command")
            out.append(Block(rel, i + 1, "bash", "setup", mark["arg"]))
        elif mark:
            if mark["what"] == "illustrative" and not mark["arg"]:
                raise DocError(f"{rel}:{i + 1}: <!-- illustrative: REASON --> needs a reason")
            pending = (mark["what"], mark["arg"], i + 1)
            if i + 1 >= len(lines) or not FENCE.match(lines[i + 1]):
                raise DocError(f"{rel}:{i + 1}: a <!-- {mark['what']} --> comment must be on the "
                               "line right before an opening ``` fence")
        elif fence:
            block, i = _block(rel, lines, i, fence, pending)
            out.append(block)
            pending = None
        i += 1
    return out


def _block(rel: str, lines: list[str], start: int, fence: re.Match[str],
           marker: tuple[str, str | None, int] | None) -> tuple[Block, int]:
    """The block opening at ``start``; returns it and the index of its closing fence."""
    indent, ticks, lang = fence["indent"], fence["ticks"], fence["lang"].lower()
    close = re.compile(rf"^[ \t]*{ticks}`*\s*$")
    end = start + 1
    while end < len(lines) and not close.match(lines[end]):
        end += 1
    if end >= len(lines):
        raise DocError(f"{rel}:{start + 1}: the fence opened here is never closed")
    body = "\n".join(ln[len(indent):] if ln.startswith(indent) else ln.lstrip()
                     for ln in lines[start + 1:end]) + "\n"
    if marker and marker[0] == "output" and lang not in ("text", ""):
        raise DocError(f"{rel}:{start + 1}: <!-- output --> marks the expected output, a text block")
    kind = "data" if marker and marker[0] == "output" else classify(lang, body)
    where = f"{rel}:{start + 1}"
    if lang == "text" and kind != "data" and not (marker and marker[0] == "output"):
        raise DocError(f"{where}: this text block starts like {kind} code; tag it "
                       f"{'bash' if kind == 'shell' else 'python'} and run it or mark it "
                       "<!-- illustrative: REASON -->")
    reason, output = None, False
    if marker is not None:
        what, arg, _ = marker
        if what == "illustrative":
            if kind == "data":
                raise DocError(f"{where}: only shell and Python blocks are marked illustrative "
                               f"(this one is {lang or 'untagged'} data)")
            reason = arg
            _check_reason(where, reason or "")
        else:
            output = True
    return Block(rel, start + 1, lang, kind, body, reason, output), end


def _check_reason(where: str, reason: str) -> None:
    """A reason that names a test file names one that exists."""
    for name in re.findall(r"tests/[\w/.-]+\.py", reason):
        if not (ROOT / name).is_file():
            raise DocError(f"{where}: the illustrative reason names {name}, which does not exist")


def expected_lines(block: Block) -> list[re.Pattern[str]]:
    """The patterns an <!-- output --> block's lines become (``...`` matches anything)."""
    return [re.compile(".*?".join(map(re.escape, ln.strip().split("..."))))
            for ln in block.text.splitlines() if ln.strip()]


def missing_output(block: Block, printed: str) -> str | None:
    """The first expected line of ``block`` that ``printed`` lacks (in order), else None."""
    got = [ln.strip() for ln in printed.splitlines()]
    at = 0
    for pat in expected_lines(block):
        while at < len(got) and not pat.fullmatch(got[at]):
            at += 1
        if at == len(got):
            return pat.pattern
        at += 1
    return None


def counts(blocks: list[Block]) -> tuple[int, int]:
    """(blocks run, blocks marked illustrative) of one doc (setup comments not counted)."""
    code = [b for b in blocks if b.kind in ("shell", "python")]
    return sum(b.illustrative is None for b in code), sum(b.illustrative is not None for b in code)


def _table() -> Iterator[str]:
    total = [0, 0]
    for path in docs():
        run, marked = counts(parse(path))
        total[0] += run
        total[1] += marked
        yield f"{path.relative_to(ROOT)!s:24} run {run:3}   illustrative {marked:3}"
    yield f"{'all':24} run {total[0]:3}   illustrative {total[1]:3}"


if __name__ == "__main__":
    try:
        print("\n".join(_table()))
    except DocError as exc:
        sys.exit(str(exc))
