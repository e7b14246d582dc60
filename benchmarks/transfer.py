"""Transfer engine benchmark: kvplane tcp/shm/nixl vs real Mooncake TCP and bare NIXL agents vs
raw socket and memcpy.

Usage: python benchmarks/transfer.py [kvplane bench transfer options]
(e.g. --sizes 4KiB,64KiB,1MiB --duration 0.5 --json). See ``kvplane bench transfer --help``.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Run ``kvplane bench transfer`` with ``argv``."""
    from kvplane.cli.main import build

    app = build()
    try:
        app(["bench", "transfer", *(sys.argv[1:] if argv is None else argv)], standalone_mode=False)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
