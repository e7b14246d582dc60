"""The README matches the code: every ``kvplane`` subcommand and every docs file is listed."""

import pathlib
import re

import pytest
import typer.main

from kvplane.cli.main import build

pytestmark = pytest.mark.timeout(30)
ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_every_subcommand_is_in_the_readme():
    commands = sorted(typer.main.get_command(build()).commands)
    assert commands, "no subcommands registered"
    missing = [c for c in commands if not re.search(rf"\b{re.escape(c)}\b", README)]
    assert missing == [], f"README does not mention: {missing}"


def test_every_docs_file_is_in_the_docs_list():
    docs_list = README[README.index("## Docs"):]
    docs_list = docs_list[: docs_list.index("\n## ", 4)]
    listed = re.findall(r"docs/([\w.-]+\.md)", docs_list)
    assert len(listed) == len(set(listed)), f"a docs file is listed twice: {listed}"
    on_disk = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert sorted(listed) == on_disk
