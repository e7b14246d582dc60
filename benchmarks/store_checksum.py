"""Cost of store checksums on get_into, measured A/B in one client: checksums off and on
alternate every ``--slice`` seconds for ``--rounds`` rounds, so load from other processes hits
both sides alike. A master and a segment process are started on 127.0.0.1; the client reads
over ``tcp`` and over shared memory (``auto``). Prints the median latency of each side and the
cost (on / off - 1).

Usage: python benchmarks/store_checksum.py [--sizes 4096,1048576] [--rounds 30] [--slice 0.15] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import numpy as np


def measure(master: str, protocol: str, size: int, rounds: int, slice_s: float) -> dict[str, float]:
    """Median get_into latency (us) with checksums off and on, alternating."""
    from kvplane.store.client.client import StoreClient

    with StoreClient(master=master, protocol=protocol, checksum=True) as c:
        buf = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
        addr = c.register_buffer(buf)
        keys = [f"{protocol}-{size}-{i}" for i in range(16)]
        for k in keys:
            c.put_from(k, addr, size)  # stored with their checksums
        sides = {False: dataclasses.replace(c.config, checksum=False), True: c.config}
        lat: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(rounds):
            for on, cfg in sides.items():
                c.config = cfg
                end, i = time.monotonic() + slice_s, 0
                while time.monotonic() < end:
                    t = time.perf_counter()
                    c.get_into(keys[i % len(keys)], addr, size)
                    lat[on].append(time.perf_counter() - t)
                    i += 1
    off, on = (statistics.median(lat[k]) * 1e6 for k in (False, True))
    return {"protocol": protocol, "size": size, "off_p50_us": off, "on_p50_us": on,
            "cost": on / off - 1, "gets_off": len(lat[False]), "gets_on": len(lat[True])}


def main(argv: list[str] | None = None) -> int:
    from tests.support.store_procs import spawn_master, spawn_segment

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4096,1048576")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--slice", type=float, default=0.15, help="seconds per side per round")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    with spawn_master() as m, spawn_segment(m.info["master"], "256MiB"):
        for size in [int(s) for s in a.sizes.split(",")]:
            for protocol in ("tcp", "auto"):
                r = measure(m.info["master"], protocol, size, a.rounds, a.slice)
                print(json.dumps(r) if a.json else
                      f"{protocol:4s} {size:>8d} B get_into p50: checksums off {r['off_p50_us']:7.0f} us,"
                      f" on {r['on_p50_us']:7.0f} us, cost {r['cost']:+.1%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
