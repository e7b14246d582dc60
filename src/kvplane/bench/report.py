"""What a benchmark shows while it runs and once it is done; shared by every ``kvplane bench``
command (the per-benchmark cores only call ``progress``).

A core calls ``progress(label)`` as each step (a side, a cell) starts, and
``progress(skip(side, why))`` for each side it leaves out. :class:`Steps` turns those calls into
a progress bar on a terminal, or one line per step on a pipe, and prints every skip line once,
so it stays on screen. :func:`table_console` prints tables whole when piped (rich would cut
cells to 80 columns). Imports rich (a dependency, through typer) and nothing of kvplane.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from types import TracebackType
from typing import Any, Self

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

_ROUND = re.compile(r"^\[\d+/\d+\] ")  # the prefix ``numbered`` puts on repeated rounds' lines
SKIPPED = "skipped "


def skip(side: str, why: str) -> str:
    """The progress line of a side left out: ``skipped mooncake: not installed (...)``."""
    return f"{SKIPPED}{side}: {why}"


def is_skip(line: str) -> bool:
    """Whether a progress line says a side was skipped (after any round prefix)."""
    return _ROUND.sub("", line).startswith(SKIPPED)


def table_console() -> Console:
    """Where result tables go: stdout, as wide as a table needs when it is not a terminal."""
    return Console() if sys.stdout.isatty() else Console(width=1000)


class Steps:
    """The ``progress`` callable handed to a benchmark core: a bar over ``total`` steps.

    On a terminal (stderr) it is a rich bar with the current step's label; elsewhere one line
    per step (``[3/12] kvplane-tcp remote x1``). Skip lines are printed once each, whatever
    the round. ``done`` counts the steps started; ``skipped`` holds the skip lines.
    """

    def __init__(self, total: int, quiet: bool = False, console: Console | None = None) -> None:
        self.total = max(total, 1)
        self.quiet = quiet
        self.done = 0
        self.skipped: list[str] = []
        self.console = console or Console(stderr=True)
        self._bar: Progress | None = None
        self._task: Any = None

    def __enter__(self) -> Steps:
        if self.console.is_terminal and not self.quiet:
            self._bar = Progress(TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), console=self.console)
            self._bar.start()
            self._task = self._bar.add_task("starting", total=self.total)
        return self

    def __call__(self, line: str) -> None:
        if is_skip(line):
            text = _ROUND.sub("", line)
            if text not in self.skipped:
                self.skipped.append(text)
                self.console.print(text, markup=False, highlight=False, soft_wrap=True)
            return
        line = line.removeprefix("[1/1] ")  # a round number says something only when repeated
        self.done += 1  # first: a Ctrl-C while this prints still counts the step as started
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done - 1, description=line)
        elif not self.quiet:
            self.console.print(f"[{self.done}/{self.total}] {line}", markup=False,
                               highlight=False, soft_wrap=True)

    def finish(self) -> None:
        """Fill the bar: every step ended."""
        if self._bar is not None:
            self._bar.update(self._task, completed=self.total, description="done")

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.stop()

    def interrupted(self) -> str:
        """The line printed when Ctrl-C ends the run."""
        return (f"interrupted in step {self.done} of {self.total}: the results of the steps "
                "that finished follow")


class Rows(list[dict[str, Any]]):
    """A core's list of result rows that also hands each row to ``sink`` as it is added, so a
    run that Ctrl-C ends still has what it measured (``rows += ...`` and ``append`` forward)."""

    def __init__(self, sink: list[dict[str, Any]] | None) -> None:
        super().__init__()
        self.sink = sink

    def append(self, row: dict[str, Any]) -> None:
        super().append(row)
        if self.sink is not None:
            self.sink.append(row)

    def __iadd__(self, rows: Iterable[dict[str, Any]]) -> Self:  # type: ignore[override,misc]  # typeshed declares list.__iadd__ so too
        for row in rows:
            self.append(row)
        return self
