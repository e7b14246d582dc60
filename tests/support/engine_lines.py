"""The JSON-line loop of an engine driver (runs inside the engines venv).

A driver prints one JSON ready line, then answers each JSON command line (``{"op": NAME, ...}``)
with one JSON reply line; an op may print ``{"stage": ...}`` lines before its reply (see
:func:`stage`). Engines log to stdout too, so the protocol gets its own copy of fd 1 and fd 1
is pointed at stderr: nothing an engine prints can corrupt a reply.

Test kit, not product.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, TextIO

_out: TextIO | None = None


def _protocol() -> TextIO:
    global _out
    if _out is None:
        _out = os.fdopen(os.dup(1), "w", buffering=1)
        sys.stdout.flush()
        os.dup2(2, 1)
    return _out


def send(obj: dict[str, Any]) -> None:
    """Write one protocol line."""
    out = _protocol()
    out.write(json.dumps(obj) + "\n")
    out.flush()


def stage(name: str, **info: Any) -> None:
    """Tell the test where an op is (e.g. ``loading``: the transfer starts now)."""
    send({"stage": name, **info})


def clear_pool(backend: Any) -> Any:
    """Force-remove every object of the pool a benchmarked backend uses (between timed runs, so
    the next run reuses memory the last one touched). kvplane's backends hold a ``client``
    (StoreClient), the engines' Mooncake backends a ``store`` (MooncakeDistributedStore)."""
    if hasattr(backend, "client"):
        return backend.client.remove_by_regex(".*", force=True)
    return backend.store.remove_by_regex(".*", True)


def mooncake_origin() -> str | None:
    """Where ``import mooncake`` comes from here (the kvplane shim, real Mooncake, or None)."""
    spec = importlib.util.find_spec("mooncake")
    return None if spec is None else str(spec.origin)


def serve(ops: dict[str, Callable[..., dict[str, Any]]], ready: dict[str, Any]) -> None:
    """Answer commands from stdin until EOF or ``{"op": "exit"}``; an op's exception becomes
    ``{"error": ..., "traceback": ...}`` (the driver keeps serving)."""
    _protocol()
    send({"ready": True, "mooncake": mooncake_origin(), **ready})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        name = cmd.pop("op")
        if name == "exit":
            send({"bye": True})
            return
        try:
            reply = ops[name](**cmd)
        except Exception as exc:  # reported to the test, which decides
            reply = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        send(reply)
