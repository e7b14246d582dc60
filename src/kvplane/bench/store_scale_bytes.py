"""``benchmarks/store_scale.py bytes``: see :mod:`kvplane.bench.store_scale_cpu`, which runs all three."""

from __future__ import annotations

from kvplane.bench.store_scale_cpu import cli


def main(argv: list[str] | None = None) -> int:
    """Run the ``bytes`` measurement with ``argv`` (``--help`` lists the options)."""
    return cli("bytes", argv)
