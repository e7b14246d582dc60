"""Standalone transfer-engine benchmark worker (runs under any Python with numpy).

Measures a Mooncake-API ``TransferEngine`` between two processes: this one (initiator) and a
spawned target. ``--impl kvplane`` uses ``kvplane.compat.mooncake``; ``--impl mooncake`` uses
the real ``mooncake.engine`` (run it with the interpreter that has Mooncake installed). The
same loop measures both, so the comparison is fair. Prints one JSON object per cell.

It imports nothing from kvplane unless ``--impl kvplane``: it must run in Mooncake's venv.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time

import numpy as np


def engine_class(impl: str):
    if impl == "mooncake":
        from mooncake.engine import TransferEngine
    else:
        from kvplane.compat.mooncake import TransferEngine
    return TransferEngine


def _target(conn, impl: str, protocol: str, buf_bytes: int, managed: bool) -> None:
    te = engine_class(impl)()
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "")
    keep = None
    if managed:
        addr = te.allocate_managed_buffer(buf_bytes)
        rc2 = 0 if addr else -1
    else:
        keep = np.empty(buf_bytes, np.uint8)
        keep.fill(0x5A)
        addr = keep.ctypes.data
        rc2 = te.register_memory(addr, buf_bytes)
    conn.send((rc, rc2, f"127.0.0.1:{te.get_rpc_port()}", addr))
    conn.recv()
    del keep


def _kvplane_slices() -> dict:
    """Slices each kvplane transport was handed in this process (which one moved the bytes)."""
    from kvplane.common import metrics

    return {"slices": {smp.labels["transport"]: smp.value
                       for m in metrics.TRANSFER_SLICES.collect() for smp in m.samples
                       if smp.name.endswith("_total")}}


def _pct(v: list[int], q: float) -> float:
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))] / 1e3 if v else float("nan")


def measure(te, ep: str, lp: int, rp: int, nbytes: int, size: int, k: int, op: str,
            duration: float, min_calls: int) -> dict:
    nslots = nbytes // size
    single = te.transfer_sync_write if op == "write" else te.transfer_sync_read
    batch = te.batch_transfer_sync_write if op == "write" else te.batch_transfer_sync_read
    lat: list[int] = []
    slot = 0
    t0 = time.perf_counter()
    end = t0 + duration
    while time.perf_counter() < end or len(lat) < min_calls:
        offs = [((slot + j) % nslots) * size for j in range(k)]
        slot = (slot + k) % nslots
        x = time.perf_counter_ns()
        if k == 1:
            rc = single(ep, lp + offs[0], rp + offs[0], size)
        else:
            rc = batch(ep, [lp + o for o in offs], [rp + o for o in offs], [size] * k)
        lat.append(time.perf_counter_ns() - x)
        if rc != 0:
            raise RuntimeError(f"{op} size={size} batch={k} returned {rc}")
    el = time.perf_counter() - t0
    lat.sort()
    return dict(op=op, size=size, batch=k, calls=len(lat), ops_s=len(lat) * k / el,
                gb_s=len(lat) * k * size / el / 1e9, p50_us=_pct(lat, .5), p99_us=_pct(lat, .99))


def run_cells(te, ep: str, lp: int, raddr: int, loc: np.ndarray, a: argparse.Namespace,
              label: str, extra=dict) -> bool:
    """Warm up, print one JSON row per (size, op, batch) cell, then check the bytes; prints and
    returns the verdict (with the fields ``extra()`` returns). ``te`` is anything with
    Mooncake's four sync transfer calls."""
    nbytes = loc.nbytes
    # connect and warm up both directions (not measured): first calls pay one-time costs
    for op in ("write", "read"):
        measure(te, ep, lp, raddr, nbytes, 4096, 1, op, min(0.3, a.duration), 1)
    for size in (int(s) for s in a.sizes.split(",")):
        for op in a.ops.split(","):
            for b in (int(x) for x in a.batches.split(",")):
                k = max(1, min(b, nbytes // size))
                if b > 1 and k == 1:
                    continue
                res = measure(te, ep, lp, raddr, nbytes, size, k, op, a.duration, a.min_calls)
                res.update(impl=label, batch_asked=b)
                print(json.dumps(res), flush=True)
    ok = verify(te, ep, lp, raddr, loc)
    print(json.dumps(dict(impl=label, verified=ok, **extra())), flush=True)
    return ok


def verify(te, ep: str, lp: int, raddr: int, loc: np.ndarray) -> bool:
    """A fresh pattern written, then read back into zeroed memory."""
    n = min(loc.nbytes, 1 << 20)
    loc[:n] = 0x3C
    if te.transfer_sync_write(ep, lp, raddr, n) != 0:
        raise RuntimeError("verify write failed")
    loc[:n] = 0
    if te.transfer_sync_read(ep, lp, raddr, n) != 0:
        raise RuntimeError("verify read failed")
    return bool((loc[:n] == 0x3C).all())


def options(description: str | None) -> argparse.ArgumentParser:
    """The options every worker takes (cells, buffer, timing)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--label", default=None)
    ap.add_argument("--sizes", default="4096,65536,1048576,16777216,67108864")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--ops", default="write,read")
    ap.add_argument("--buf-mb", type=int, default=512)
    ap.add_argument("--duration", type=float, default=1.0)
    ap.add_argument("--min-calls", type=int, default=3)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = options(__doc__)
    ap.add_argument("--impl", choices=["kvplane", "mooncake"], default="kvplane")
    ap.add_argument("--protocol", default="tcp")
    ap.add_argument("--managed", action="store_true", help="target memory from allocate_managed_buffer")
    a = ap.parse_args(argv)
    label = a.label or f"{a.impl}-{a.protocol}"
    nbytes = a.buf_mb << 20
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, a.impl, a.protocol, nbytes, a.managed), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError("target did not start within 60 s")
        rc, rc2, ep, raddr = parent.recv()
        if rc or rc2:
            raise RuntimeError(f"target init failed rc={rc} reg={rc2}")
        te = engine_class(a.impl)()
        if te.initialize("127.0.0.1", "P2PHANDSHAKE", a.protocol, "") != 0:
            raise RuntimeError("initiator init failed")
        loc = np.empty(nbytes, np.uint8)
        loc.fill(0xA5)
        lp = loc.ctypes.data
        if te.register_memory(lp, nbytes) != 0:
            raise RuntimeError("register_memory failed")
        ok = run_cells(te, ep, lp, raddr, loc, a, label,
                       _kvplane_slices if a.impl == "kvplane" else dict)
        return 0 if ok else 1
    finally:
        parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
