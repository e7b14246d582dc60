"""Reading traces in the Mooncake format (the format is the contract) and labelling turns.

One JSON object per line: ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids``
(prefix-block hashes, one per 512-token block, last block possibly partial). Other keys are ignored.
Pure apart from reading the file; must not import the simulator.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvplane.common.errors import InvalidArgument
from kvplane.conductor.scheduling.view import Request


def parse_lines(lines: Iterable[str], load: float = 1.0, limit: int | None = None) -> list[Request]:
    """Parse trace lines into requests sorted by arrival.

    Args:
        lines: JSON lines (blank lines are skipped).
        load: arrival-rate multiplier; arrival = timestamp / 1000 / load.
        limit: keep only the first ``limit`` requests (None = all).

    Returns:
        Requests; ``rid`` is the 0-based index among non-blank lines.

    Raises:
        InvalidArgument: a line is not JSON or misses/garbles a required field.
    """
    if load <= 0:
        raise InvalidArgument("load must be > 0")
    out: list[Request] = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if limit is not None and len(out) >= limit:
            break
        try:
            row = json.loads(line)
            req = Request(len(out), float(row["timestamp"]) / 1000.0 / load,
                          int(row["input_length"]), int(row["output_length"]),
                          tuple(int(h) for h in row["hash_ids"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument(f"trace line {no}: {exc!r}") from exc
        if req.input_length < 1 or req.output_length < 0:
            raise InvalidArgument(f"trace line {no}: input_length must be >= 1, output_length >= 0")
        out.append(req)
    out.sort(key=lambda r: (r.arrival_s, r.rid))
    return out


def load_trace(path: str | Path, load: float = 1.0, limit: int | None = None) -> list[Request]:
    """Read a trace file (see :func:`parse_lines`).

    Raises:
        InvalidArgument: missing file or a bad line.
    """
    try:
        with open(path, encoding="utf-8") as f:
            return parse_lines(f, load, limit)
    except OSError as exc:
        raise InvalidArgument(f"cannot read trace {path}: {exc}") from exc


def turns(requests: Sequence[Request], block_tokens: int = 512) -> dict[int, int]:
    """Conversation turn of each request, inferred from the hashes (the trace has no session id).

    A request continues an earlier one when the earlier request's complete blocks are a prefix of
    its own: ids are prefix hashes, so the earlier request's last complete block id identifies its
    whole prefix. The turn is one more than the deepest such predecessor's, else 1. Requests with
    fewer than two complete blocks do not become predecessors, so a one-block shared head (the
    conversation trace's block 0) does not chain unrelated sessions.

    Returns:
        rid -> turn (1-based).
    """
    tails: dict[int, int] = {}
    out: dict[int, int] = {}
    for r in requests:
        turn = 1
        for h in reversed(r.hash_ids):
            got = tails.get(h)
            if got is not None:
                turn = got + 1
                break
        out[r.rid] = turn
        full = r.input_length // block_tokens
        if full >= 2 and full <= len(r.hash_ids):
            tails[r.hash_ids[full - 1]] = turn
    return out
