"""The numbers behind the store's HA design (issue 10; docs/store.md, "High availability").

Measured side by side in one run:

* ``etcd_put``: one etcd write through its JSON gateway (etcd3gw), the least an ordered oplog
  in etcd would add to every put, against ``store_put``: a whole 4 KiB store put (PutStart,
  the write, PutEnd) with a master and a segment on 127.0.0.1. ``oplog_share``: the put's time
  an oplog write would add (etcd_put / store_put).
* ``scan``: the inventory scan a segment runs when a new leader takes over
  (``inventory.scan``) over a segment filled with objects of each size, per GiB and per record.
* ``adopt``: the master's side of re-registration (``MasterState.adopt``) per record.

Usage: python benchmarks/store_ha.py [--segment-mb 256] [--sizes 4096,65536,1048576]
    [--puts 300] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import numpy as np


def etcd_vs_put(puts: int) -> dict[str, float]:
    """Median latency of an etcd write and of a 4 KiB store put, alternating."""
    from kvplane.store.client.client import StoreClient
    from kvplane.store.etcd import Etcd, HaAddress
    from tests.support.services import start_etcd
    from tests.support.store_procs import spawn_master, spawn_segment

    with tempfile.TemporaryDirectory() as tmp:
        svc = start_etcd(tmp)
        etcd = Etcd(HaAddress.parse(svc.url).endpoints, timeout=2.0)
        m = spawn_master()
        seg = spawn_segment(m.info["master"], "64MiB")
        try:
            with StoreClient(master=m.info["master"], protocol="tcp") as c:
                value = bytes(4096)
                lat: dict[str, list[float]] = {"etcd_put": [], "store_put": []}
                for i in range(puts):
                    t = time.perf_counter()
                    etcd.put(f"oplog/{i}", value[:64])
                    lat["etcd_put"].append(time.perf_counter() - t)
                    t = time.perf_counter()
                    c.put(f"k{i}", value)
                    lat["store_put"].append(time.perf_counter() - t)
        finally:
            seg.stop()
            m.stop()
            etcd.close()
            svc.stop()
    e, s = (statistics.median(lat[k]) * 1e6 for k in ("etcd_put", "store_put"))
    return {"bench": "oplog", "etcd_put_p50_us": e, "store_put_p50_us": s, "oplog_share": e / s}


def fill(mem: np.ndarray, size: int) -> int:
    """Fill ``mem`` with records of ``size``-byte values, as puts leave them; returns how many."""
    from kvplane.store import inventory
    from kvplane.store.checksum import digest

    secret = inventory.secret_of("bench")
    value = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    csum = digest(memoryview(value))
    off, n = 0, 0
    while True:
        key = f"obj-{n:08d}"
        head = inventory.pack(secret, key, (7 << 40) | (n + 1), (7 << 40) | (n + 1), size, csum)
        step = (len(head) + size + 63) // 64 * 64
        if off + step > len(mem):
            return n
        mem[off:off + len(head)] = np.frombuffer(head, np.uint8)
        mem[off + len(head):off + len(head) + size] = value
        off, n = off + step, n + 1


def scan_and_adopt(segment_mb: int, size: int) -> dict[str, float]:
    """Scan a full segment of ``size``-byte objects, then adopt every record on a fresh master."""
    from kvplane.store import inventory
    from kvplane.store.master.config import MasterConfig
    from kvplane.store.master.state import MasterState
    from kvplane.store.types import SegmentInfo

    mem = np.zeros(segment_mb << 20, np.uint8)
    n = fill(mem, size)
    t = time.perf_counter()
    found = inventory.scan(mem, inventory.secret_of("bench"), [7])
    scan_s = time.perf_counter() - t
    assert len(found.records) == n, (len(found.records), n)
    st = MasterState(MasterConfig(), epoch=9)
    st.mount("c", [SegmentInfo("s", 0, len(mem), "", "s:1", "h")], 0.0, adopt=True)
    t = time.perf_counter()
    for start in range(0, n, 2048):  # the segment's batches
        st.adopt("c", "s", found.records[start:start + 2048], [7], start + 2048 >= n, 0.0)
    adopt_s = time.perf_counter() - t
    assert len(st.objects) == n
    return {"bench": "recovery", "size": size, "records": n, "segment_mb": segment_mb,
            "scan_s": scan_s, "scan_s_per_gib": scan_s * 1024 / segment_mb,
            "scan_us_per_record": scan_s / n * 1e6, "adopt_us_per_record": adopt_s / n * 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--segment-mb", type=int, default=256)
    ap.add_argument("--sizes", default="4096,65536,1048576")
    ap.add_argument("--puts", type=int, default=300)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    rows = [etcd_vs_put(a.puts)]
    rows += [scan_and_adopt(a.segment_mb, int(s)) for s in a.sizes.split(",")]
    for r in rows:
        if a.json:
            print(json.dumps(r))
        elif r["bench"] == "oplog":
            print(f"etcd write p50 {r['etcd_put_p50_us']:.0f} us vs 4 KiB store put p50 "
                  f"{r['store_put_p50_us']:.0f} us: an oplog write adds "
                  f"{r['oplog_share']:.2f}x a put")
        else:
            print(f"{r['size']:>8} B objects: {r['records']} records in {r['segment_mb']} MiB: "
                  f"scan {r['scan_s']:.3f} s ({r['scan_s_per_gib']:.2f} s/GiB, "
                  f"{r['scan_us_per_record']:.1f} us/record), adopt "
                  f"{r['adopt_us_per_record']:.1f} us/record")
    return 0


if __name__ == "__main__":
    sys.exit(main())
