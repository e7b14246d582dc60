"""What every long-running ``kvplane`` command does around its service: announce, then wait.

``announce`` prints the one JSON ready line (and optionally writes it to a file) once every
listener is bound; tests and scripts wait on that line. ``wait_for_signal`` blocks until SIGTERM
or SIGINT.
"""

from __future__ import annotations

import json
import signal
import threading

import typer


def wait_for_signal() -> None:
    """Block until SIGTERM or SIGINT."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()


def announce(info: dict[str, object], ready_file: str | None) -> None:
    """Print the ready line (one JSON object) on stdout; also write it to ``ready_file``."""
    line = json.dumps(info)
    typer.echo(line, nl=True)
    if ready_file:
        with open(ready_file, "w", encoding="utf-8") as f:
            f.write(line + "\n")
