"""Optional plots of the CLI's tools (``simulate``, ``bench``): results first, then the plots,
and without matplotlib one line saying they were skipped instead of a failure."""

from __future__ import annotations

from collections.abc import Callable

import typer


def missing() -> str | None:
    """Why plots cannot be drawn here (matplotlib absent: the ``[plots]`` extra), else None."""
    from kvplane.common.errors import MissingExtra
    from kvplane.common.extras import pyplot

    try:
        pyplot()
    except MissingExtra as exc:
        return str(exc)
    return None


def skipped(command: str, why: str) -> None:
    """The one line (on stderr) that says ``command``'s plots were not drawn, and why."""
    typer.echo(f"{command}: plots skipped: {why}", err=True)


def draw(command: str, plot: Callable[[], object], done: str) -> None:
    """Run ``plot`` and say ``done`` (on stderr: stdout may be JSON), or, without matplotlib,
    the one skip line."""
    why = missing()
    if why is not None:
        skipped(command, why)
        return
    plot()
    typer.echo(done, err=True)
