"""Store benchmark: kvplane vs real Mooncake store vs Redis, side by side in one run.

Usage: python benchmarks/store.py [kvplane bench store options] (see ``kvplane bench store --help``).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Run ``kvplane bench store`` with ``argv``."""
    from kvplane.cli.main import build

    try:
        build()(["bench", "store", *(sys.argv[1:] if argv is None else argv)], standalone_mode=False)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
