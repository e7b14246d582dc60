"""The SSD tier's benchmark row: a get from DRAM vs from the SSD tier vs recomputing the KV.

``python benchmarks/store.py --disk-tier [--size 1MiB --objects 32 --json]``

One master and one ``kvplane segment --disk-dir`` process (write-through), one client on the
same host (protocol auto: shared memory for memory replicas). Each object is read once per pass,
so every read of an SSD pass finds the object on disk only (the node is restarted cleanly between
passes: it re-adopts its files and its memory starts empty):

* ``dram``: the objects in the node's memory;
* ``ssd-cold`` / ``ssd-direct-cold``: on disk only, evicted from the page cache first
  (``posix_fadvise(DONTNEED)``), read by the node through the page cache or with O_DIRECT;
* ``ssd-warm``: on disk only, files still in the page cache;
* ``recompute``: NOT measured here: the prefill time per token of the vLLM TTFT benchmark
  (docs/benchmarks.md, "vLLM TTFT", run 2: 668 ms for a 2,000-token prompt, 16 KiB of KV per
  token), times the tokens one object holds.

Also the raw file read alone (``layout.read_into``), page cache vs O_DIRECT, cold and warm.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PREFILL_MS_PER_TOKEN = 668.0 / 2000  # docs/benchmarks.md, vLLM TTFT, run 2 (recompute)
KV_BYTES_PER_TOKEN = 16 << 10  # that model: 2 x 4 layers x 512 hidden x fp32


def drop_cache(root: Path) -> None:
    """Evict the tier's files from the page cache (only them: other processes keep theirs)."""
    for path in root.rglob("*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _row(tier: str, size: int, lat: list[float], **extra: Any) -> dict[str, Any]:
    lat = sorted(lat)
    p50 = statistics.median(lat) * 1e6
    return {"row": "store", "tier": tier, "size": size, "n": len(lat), "p50_us": round(p50),
            "p99_us": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6),
            "GB_s": round(size / statistics.median(lat) / 1e9, 3), **extra}


def _node(addr: str, root: Path, seg_mb: int, direct: bool) -> Any:
    from kvplane.bench.services import spawn_segment

    return spawn_segment(addr, f"{seg_mb}MiB", "--disk-dir", str(root), "--disk-size", "8GiB",
                         "--disk-write-through", "--disk-direct" if direct else "--disk-page-cache")


def _gets(client: Any, keys: list[str], values: dict[str, bytes]) -> list[float]:
    out = []
    for key in keys:
        t0 = time.perf_counter()
        got = client.get(key)
        out.append(time.perf_counter() - t0)
        if got != values[key]:
            raise RuntimeError(f"{key}: wrong bytes")
    return out


def store_rows(size: int, n: int, root: Path) -> tuple[list[dict[str, Any]], str]:
    """The store rows, and the token the processes used (it keys the files' tags)."""
    from kvplane.bench.services import spawn_master
    from kvplane.common.procs import wait_until
    from kvplane.store.client.client import StoreClient
    from kvplane.store.client.replica_ops import ReplicaOps

    seg_mb = max(64, 2 * n * size >> 20)
    rows = []
    with spawn_master() as m, StoreClient(master=m.info["master"], timeout=30) as c:
        addr = m.info["master"]
        token = c.config.token
        keys = [f"disk-bench-{i}" for i in range(n)]
        values = {k: os.urandom(size) for k in keys}
        node = _node(addr, root, seg_mb, False)
        try:
            for k in keys:
                c.put(k, values[k])
            ops = ReplicaOps(c)
            wait_until(lambda: all(len(r.replicas) == 2 for r in ops.descs(keys)), 60,
                       "every object on disk")
            _gets(c, keys, values)  # warm the client's mappings
            rows.append(_row("dram", size, _gets(c, keys, values)))
            for tier, direct, cold in (("ssd-cold", False, True), ("ssd-warm", False, False),
                                       ("ssd-direct-cold", True, True)):
                node.stop()
                node = _node(addr, root, seg_mb, direct)
                if cold:
                    drop_cache(root)
                rows.append(_row(tier, size, _gets(c, keys, values)))
        finally:
            node.stop()
    tokens = size / KV_BYTES_PER_TOKEN
    rows.append({"row": "store", "tier": "recompute", "size": size, "tokens": tokens,
                 "p50_us": round(tokens * PREFILL_MS_PER_TOKEN * 1000), "measured": False,
                 "source": "docs/benchmarks.md vLLM TTFT run 2: 668 ms / 2000 tokens"})
    return rows, token


def file_rows(size: int, n: int, root: Path, token: str) -> list[dict[str, Any]]:
    """The file read alone: page cache vs O_DIRECT, cold and warm."""
    from kvplane.store import inventory
    from kvplane.store.disk import layout

    secret = inventory.secret_of(token)
    paths = list(root.rglob("*.kv"))[:n]
    recs = [layout.read_header(p, secret) for p in paths]
    dest = memoryview(bytearray(max(r.hdr + r.size for r in recs)))
    rows = []
    for mode, direct, cold in (("cached-cold", False, True), ("direct-cold", True, True),
                               ("cached-warm", False, False), ("direct-warm", True, False)):
        if cold:
            drop_cache(root)
        else:
            for p, r in zip(paths, recs):
                layout.read_into(p, r, dest, secret)
        lat = []
        for p, r in zip(paths, recs):
            t0 = time.perf_counter()
            layout.read_into(p, r, dest, secret, direct=direct)
            lat.append(time.perf_counter() - t0)
        rows.append(_row(mode, size, lat, row="file"))
    return rows


def _print(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        for r in rows:
            print(json.dumps(r))
        return
    dram = next((r["p50_us"] for r in rows if r.get("tier") == "dram"), None)
    print(f"{'row':6} {'tier/mode':16} {'size':>9} {'p50 us':>9} {'p99 us':>9} {'GB/s':>7} "
          f"{'x dram':>7}")
    for r in rows:
        name = r.get("tier", "")
        ratio = f"{r['p50_us'] / dram:7.1f}" if dram and r["row"] == "store" else ""
        print(f"{r['row']:6} {name:16} {r['size']:>9} {r['p50_us']:>9} {r.get('p99_us', ''):>9} "
              f"{r.get('GB_s', ''):>7} {ratio:>7}")


def main(argv: list[str] | None = None) -> int:
    from kvplane.common.config import parse_size

    ap = argparse.ArgumentParser(prog="benchmarks/store.py --disk-tier")
    ap.add_argument("--size", default="1MiB", help="Object size (1 MiB = 64 tokens of KV).")
    ap.add_argument("--objects", type=int, default=32, help="Objects per pass.")
    ap.add_argument("--dir", default=None, help="Disk tier directory (default: a temporary one).")
    ap.add_argument("--json", action="store_true", help="One JSON object per row.")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    size = parse_size(args.size)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rows, token = store_rows(size, args.objects, Path(tmp))
        rows += file_rows(size, args.objects, Path(tmp), token)
    _print(rows, args.json)
    return 0
