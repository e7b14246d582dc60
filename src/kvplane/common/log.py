"""Logging: diagnostic loggers (``logging.getLogger(__name__)``) plus structured event loggers.

Event loggers live under ``kvplane.events.*`` and take a dict per record (quorum changes,
failovers, evictions...). :func:`setup` is called once by the CLI; libraries never configure
logging themselves.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_context: dict[str, Any] = {}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, context, and the event dict if any."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(_context)
        event = getattr(record, "event", None)
        if isinstance(event, dict):
            out.update(event)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup(level: str = "INFO", json_lines: bool = False) -> None:
    """Configure the ``kvplane`` logger tree once (idempotent)."""
    root = logging.getLogger("kvplane")
    root.setLevel(level.upper())
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.propagate = False


def set_context(**kv: Any) -> None:
    """Attach fields (node id, rank, ...) to every JSON record of this process."""
    _context.update(kv)


def event(name: str, **fields: Any) -> None:
    """Emit a structured event on ``kvplane.events.<name>``."""
    logging.getLogger(f"kvplane.events.{name}").info(
        "%s %s", name, fields, extra={"event": {"event": name, "t": time.time(), **fields}}
    )
