"""Metadata at scale (issue 32): the master's memory, pauses and RPC cost, cold reads, puts and
bytes-returning gets, side by side with Mooncake; sharded metadata against one master.

Usage: python benchmarks/store_scale.py SUBCOMMAND [options]   (SUBCOMMAND --help for its options)

Each subcommand is one module's ``main(argv)``; adding one is one line in ``COMMANDS``.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {  # subcommand -> module with main(argv) -> int
    "memory": "kvplane.bench.store_scale_memory",  # master RSS per object, kvplane vs Mooncake
    "pauses": "kvplane.bench.store_scale_pauses",  # longest lock hold / RPC wait during long passes
    "cpu": "kvplane.bench.store_scale_cpu",  # master CPU per 100k ops, kvplane vs Mooncake
    "cold": "kvplane.bench.store_scale_cold",  # cold single gets and single puts (1..N segments)
    "bytes": "kvplane.bench.store_scale_bytes",  # get() returning bytes over a large working set
    "table": "kvplane.bench.store_scale_table",  # per-key cost of the object table, C vs Python
    "placement": "kvplane.bench.store_scale_placement",  # master's per-put cost vs segments
    "shards": "kvplane.bench.store_scale_shards",  # exists/lookup ops/s: N shards vs one master
}


def main(argv: list[str] | None = None) -> int:
    """Run the subcommand named by ``argv[0]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in COMMANDS:
        print(f"usage: store_scale.py {{{','.join(COMMANDS)}}} [options]", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[args[0]])
    return int(module.main(args[1:]))


if __name__ == "__main__":
    sys.exit(main())
