"""``benchmarks/store_scale.py memory``: the master's RSS per object, kvplane beside real
Mooncake, in one run.

Each side gets a fresh master process; its RSS (``VmRSS``) is read once its segment is
mounted (the base) and again once it holds ``n`` objects of ``--value`` bytes under the same
keys (``k`` and a zero-padded index, ``--key-len`` bytes). Bytes per object = (RSS with the
objects - base) / n; the total RSS is reported too (the issue's target is total master RSS).

* kvplane: ``kvplane master`` in its own process; the objects go in by the master's own put
  RPCs (PutStart, PutEnd in batches of ``--batch``), as a client's puts do. No value bytes are
  written: the master holds metadata only, so its memory is the same whether or not a segment
  process ever received them (the segment is declared, not backed).
* Mooncake: ``mooncake_master`` in its own process, filled by a client of the real Mooncake
  (``store_scale_mc.py``, ``put_batch``) that holds the values in its own segment: that takes
  ``n * value`` bytes of RAM, so Mooncake runs up to ``--mooncake-max`` objects.

Sides interleave per count (Mooncake, then kvplane), each count ``--repeat`` times; the
median is reported. Imports only ``kvplane.common``, the store's wire types and the bench kit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvplane.bench.services import spawn_master
from kvplane.bench.store import Services, start_mooncake
from kvplane.bench.transfer import find_mooncake_python
from kvplane.common.rpc import RpcClient
from kvplane.store import inventory
from kvplane.store.types import (
    CodesRep,
    MountRep,
    MountReq,
    PutEndReq,
    PutStartReq,
    ReplicateConfig,
    ResultsRep,
    SegmentInfo,
)

MC_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "store_scale_mc.py")
TOKEN = "store-scale-bench-token"
CLIENT = "scale-bench"


@dataclass
class Options:
    counts: list[int] = field(default_factory=lambda: [1_000_000, 10_000_000])
    value: int = 1024
    key_len: int = 32
    batch: int = 1000
    sides: list[str] = field(default_factory=lambda: ["kvplane", "mooncake"])
    mooncake_max: int = 1_000_000
    mooncake_python: str | None = None
    repeat: int = 1


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (``VmRSS``)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def cpu_times() -> tuple[int, int]:
    """(all, steal) jiffies of the host from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    return sum(vals), vals[7] if len(vals) > 7 else 0


def host_load(before: tuple[int, int]) -> dict[str, float]:
    """The 1-minute load average now and the host's CPU steal share since ``before``."""
    total, steal = cpu_times()
    with open("/proc/loadavg") as f:
        load = float(f.read().split()[0])
    dt = max(1, total - before[0])
    return {"load1": load, "steal_pct": round(100.0 * (steal - before[1]) / dt, 2)}


def key_of(i: int, key_len: int) -> str:
    """The ``i``-th key: ``k`` and the zero-padded index, ``key_len`` bytes."""
    return f"k{i:0{key_len - 1}d}"


def kvplane_side(n: int, opt: Options) -> dict[str, Any]:
    """Fill a fresh kvplane master with ``n`` objects; its RSS before and after."""
    hdr = inventory.header_len(key_of(0, opt.key_len))
    per = (hdr + opt.value + 63) // 64 * 64
    master = spawn_master("--token", TOKEN, "--client-ttl", "86400")
    try:
        rpc = RpcClient(master.info["master"], token=TOKEN, timeout=120.0)
        seg = SegmentInfo("scale-seg", 1 << 40, per * n * 5 // 4 + (1 << 20), CLIENT,
                          "127.0.0.1:9", "scale-host")
        rpc.call("mount", MountReq(CLIENT, [seg]), MountRep)
        base = rss_bytes(master.pid)
        t0 = time.perf_counter()
        cfg = ReplicateConfig()
        for start in range(0, n, opt.batch):
            keys = [key_of(i, opt.key_len) for i in range(start, min(n, start + opt.batch))]
            got = rpc.call("put_start", PutStartReq(CLIENT, keys, [opt.value] * len(keys), cfg,
                                                    checksums=[1] * len(keys)), ResultsRep)
            if any(r.code for r in got.results):
                raise RuntimeError(f"put_start failed at {start}: {got.results[0].code}")
            done = rpc.call("put_end", PutEndReq(CLIENT, keys, [r.version for r in got.results],
                                                 [1] * len(keys)), CodesRep)
            if any(done.codes):
                raise RuntimeError(f"put_end failed at {start}")
        fill = time.perf_counter() - t0
        rss = rss_bytes(master.pid)
        rpc.close()
    finally:
        master.stop()
    return _row("kvplane", n, base, rss, fill)


def mooncake_side(n: int, opt: Options, py: str) -> dict[str, Any]:
    """Fill a fresh Mooncake master with ``n`` objects through a real client; RSS before and
    after."""
    svc = Services()
    try:
        master, url = start_mooncake(svc, py, False, 0)
        mc_pid = svc.procs[-1].pid
        seg = n * opt.value * 3 // 2 + (256 << 20)
        env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1", GLOG_minloglevel="2")
        worker = subprocess.Popen(
            [py, MC_WORKER, str(n), str(opt.value), str(opt.batch), str(seg), master, url,
             str(opt.key_len)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, env=env)
        svc.procs.append(worker)
        _expect(worker, "ready")
        base = rss_bytes(mc_pid)
        assert worker.stdin is not None  # a PIPE
        worker.stdin.write("go\n")
        worker.stdin.flush()
        filled = _expect(worker, "filled")
        rss = rss_bytes(mc_pid)
        worker.stdin.write("done\n")
        worker.stdin.flush()
        worker.wait(60)
    finally:
        svc.stop()
    return _row("mooncake", n, base, rss, filled["fill_s"])


def _expect(proc: subprocess.Popen[str], field_name: str) -> dict[str, Any]:
    assert proc.stdout is not None  # a PIPE
    line = proc.stdout.readline()
    msg = json.loads(line) if line.startswith("{") else {"error": f"no answer ({line!r})"}
    if field_name not in msg:
        raise RuntimeError(f"mooncake worker: {msg.get('error', msg)}")
    return msg


def _row(side: str, n: int, base: int, rss: int, fill: float) -> dict[str, Any]:
    return {"side": side, "objects": n, "base_mb": round(base / 2**20, 1),
            "rss_mb": round(rss / 2**20, 1), "bytes_per_object": round((rss - base) / n, 1),
            "fill_s": round(fill, 1)}


def run(opt: Options, progress: Callable[[str], None] = lambda s: None) -> list[dict[str, Any]]:
    """Every count on every side, ``opt.repeat`` times interleaved; the median row per cell,
    with kvplane's ratio to Mooncake where both ran."""
    mc = find_mooncake_python(opt.mooncake_python) if "mooncake" in opt.sides else None
    if "mooncake" in opt.sides and mc is None:
        progress("mooncake not installed: its side is skipped")
    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for rep in range(max(1, opt.repeat)):
        for n in opt.counts:
            for side in opt.sides:
                if side == "mooncake" and (mc is None or n > opt.mooncake_max):
                    continue
                progress(f"[{rep + 1}/{opt.repeat}] {side} {n} objects")
                before = cpu_times()
                row = kvplane_side(n, opt) if side == "kvplane" else mooncake_side(n, opt, mc or "")
                row.update(host_load(before))
                cells.setdefault((side, n), []).append(row)
    rows = [_median(runs) for runs in cells.values()]
    by = {(r["side"], r["objects"]): r for r in rows}
    for r in rows:
        peer = by.get(("mooncake", r["objects"]))
        if r["side"] == "kvplane" and peer is not None:
            r["rss_vs_mooncake"] = round(r["rss_mb"] / peer["rss_mb"], 3)
    return rows


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    mid = statistics.median(r["rss_mb"] for r in runs)
    row = dict(min(runs, key=lambda r: abs(r["rss_mb"] - mid)))
    row["repeats"] = len(runs)
    return row


def main(argv: list[str] | None = None) -> int:
    """Command line of ``benchmarks/store_scale.py memory``."""
    ap = argparse.ArgumentParser(prog="store_scale.py memory", description=__doc__.split("\n")[0])
    ap.add_argument("--counts", default="1000000,10000000", help="objects per run, comma-separated")
    ap.add_argument("--value", type=int, default=1024, help="bytes of each value")
    ap.add_argument("--key-len", type=int, default=32, help="bytes of each key")
    ap.add_argument("--batch", type=int, default=1000, help="keys per put call")
    ap.add_argument("--sides", default="kvplane,mooncake")
    ap.add_argument("--mooncake-max", type=int, default=1_000_000,
                    help="largest count Mooncake runs (it holds the values in RAM)")
    ap.add_argument("--mooncake-python", default=None)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    a = ap.parse_args(argv)
    opt = Options([int(c) for c in a.counts.split(",")], a.value, a.key_len, a.batch,
                  a.sides.split(","), a.mooncake_max, a.mooncake_python, a.repeat)
    rows = run(opt, lambda s: print(s, file=sys.stderr, flush=True))
    for r in rows:
        if a.json:
            print(json.dumps(r))
        else:
            print("  ".join(f"{k}={v}" for k, v in r.items()))
    return 0
