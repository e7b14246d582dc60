"""Adapters that plug kvplane into inference engines.

Each subpackage imports its host framework lazily; nothing else in ``kvplane`` imports from here.
"""

__all__: list[str] = []
