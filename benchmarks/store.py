"""Store benchmark: kvplane vs real Mooncake store vs Redis, side by side in one run.

Usage: python benchmarks/store.py [kvplane bench store options] (see ``kvplane bench store --help``).
The SSD tier's row (get from DRAM vs from SSD vs recomputing): ``python benchmarks/store.py
--disk-tier [--size 1MiB --objects 32 --json]`` (``kvplane.bench.disk_tier``).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Run ``kvplane bench store`` with ``argv``."""
    from kvplane.cli.main import build

    args = list(sys.argv[1:] if argv is None else argv)
    if "--disk-tier" in args:
        from kvplane.bench import disk_tier

        return disk_tier.main([a for a in args if a != "--disk-tier"])
    try:
        build()(["bench", "store", *args], standalone_mode=False)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
