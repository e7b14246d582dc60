"""Mooncake side of ``benchmarks/store_scale.py memory``: fills a real Mooncake store.

Run by an interpreter that has ``mooncake`` (not kvplane's): it imports nothing of kvplane.
Mounts a segment of its own, says ``{"ready": ...}``, waits for a line on stdin, puts ``n``
objects of ``size`` bytes under the same keys as the kvplane side (``put_batch``), says
``{"filled": ...}`` and holds them until the next line on stdin (the parent reads the
master's RSS meanwhile).

Usage: python store_scale_mc.py N SIZE BATCH SEGMENT_BYTES MASTER METADATA_URL KEY_LEN
"""

from __future__ import annotations

import json
import sys
import time


def main(argv: list[str]) -> int:
    """Fill the store and hold it (see the module docstring)."""
    from mooncake.store import MooncakeDistributedStore

    n, size, batch, seg = (int(a) for a in argv[:4])
    master, meta, key_len = argv[4], argv[5], int(argv[6])
    st = MooncakeDistributedStore()
    rc = st.setup("127.0.0.1", meta, seg, max(64 << 20, 2 * batch * size), "tcp", "", master)
    if rc != 0:
        print(json.dumps({"error": f"setup returned {rc}"}), flush=True)
        return 1
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()
    val = b"x" * size
    t0 = time.perf_counter()
    for start in range(0, n, batch):
        keys = [f"k{i:0{key_len - 1}d}" for i in range(start, min(n, start + batch))]
        rc = st.put_batch(keys, [val] * len(keys))
        if rc != 0:
            print(json.dumps({"error": f"put_batch returned {rc} at {start}"}), flush=True)
            return 1
    print(json.dumps({"filled": n, "fill_s": time.perf_counter() - t0}), flush=True)
    sys.stdin.readline()
    st.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
