"""Checksum candidates for store objects, side by side in one run: GB/s per value size and the
ratio to xxh3-64 (the store's choice, ``kvplane.store.checksum``), with a memcpy for scale.

Usage: python benchmarks/checksum.py [--sizes 4096,1048576] [--seconds 0.5] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zlib
from collections.abc import Callable

import numpy as np
import xxhash


def candidates(buf: np.ndarray) -> dict[str, Callable[[], object]]:
    """What each candidate computes over ``buf`` (a uint8 array)."""
    view = memoryview(buf)
    words = buf[: len(buf) // 8 * 8].view(np.uint64)
    weights = np.arange(1, len(words) + 1, dtype=np.uint64)
    out = np.empty_like(buf)
    return {
        "xxh3-64": lambda: xxhash.xxh3_64_intdigest(view),
        "xxh64": lambda: xxhash.xxh64_intdigest(view),
        "zlib.crc32": lambda: zlib.crc32(view),
        "zlib.adler32": lambda: zlib.adler32(view),
        "numpy sum u64 (misses moved bytes)": lambda: int(words.sum()),
        "numpy weighted sum u64": lambda: int(np.dot(words, weights)),
        "memcpy (scale)": lambda: np.copyto(out, buf),
    }


def measure(fn: Callable[[], object], size: int, seconds: float) -> float:
    """GB/s of ``fn`` over ``size`` bytes, best of three runs of ``seconds / 3``."""
    best = 0.0
    for _ in range(3):
        n, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < seconds / 3 or n == 0:
            fn()
            n += 1
        best = max(best, n * size / elapsed / 1e9)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4096,65536,1048576,16777216")
    ap.add_argument("--seconds", type=float, default=0.6, help="per candidate and size")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    rows = []
    for size in [int(s) for s in a.sizes.split(",")]:
        buf = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
        got = {name: measure(fn, size, a.seconds) for name, fn in candidates(buf).items()}
        for name, gbs in got.items():
            rows.append({"candidate": name, "size": size, "gb_s": gbs,
                         "us_per_value": size / gbs / 1e3, "vs_xxh3": gbs / got["xxh3-64"]})
    for r in rows:
        if a.json:
            print(json.dumps(r))
        else:
            print(f"{r['candidate']:36s} {r['size']:>9d} B {r['gb_s']:7.2f} GB/s "
                  f"{r['us_per_value']:9.1f} us  {r['vs_xxh3']:5.2f}x xxh3")
    return 0


if __name__ == "__main__":
    sys.exit(main())
