"""Data files shipped with kvplane (see each folder's SOURCE.md for where they come from).

``SAMPLE_TRACE``: a 1,000-request slice of Mooncake's conversation trace (FAST'25 release).
"""

from __future__ import annotations

from pathlib import Path

SAMPLE_TRACE = Path(__file__).resolve().parent / "traces" / "conversation_sample.jsonl"

__all__ = ["SAMPLE_TRACE"]
