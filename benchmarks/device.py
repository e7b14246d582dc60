"""Staged device transfers against the device copy alone and the host transport alone.

Device memory in kvplane's engine moves through host staging on the host transports (TCP,
shared memory): chunks are copied device <-> pinned host slots on the device's copier while the
previous chunk crosses the transport (docs/transfer.md, "Device memory"). This measures, per
size and in one run, interleaved, median of ``--repeat`` rounds:

* ``copy``: the copier alone, device -> host and host -> device, chunk by chunk into the staging
  slots (on CUDA: the pinned copy bandwidth, the issue's reference);
* ``host``: the transport alone, a host buffer to a remote host buffer (WRITE and READ);
* ``staged``: the device buffer to the same remote host buffer through staging (WRITE: device ->
  remote, READ: remote -> device);

and the ratios staged / copy and staged / min(copy, host) (1.0: the pipeline hides the shorter
of the two stages entirely). The target is a second process with a host buffer.

``--device cuda:0`` uses a CUDA tensor (torch). Without CUDA the default is the stand-in device
of the tests (``tests.support.standin_device``: host memory the engine can reach only through
its copier, copies are numpy memcpys), so on CPU the numbers measure the pipeline's overhead,
not a GPU. Every transfer's bytes are checked once per cell.

Usage: python benchmarks/device.py [--device cuda:0|standin] [--sizes 4MiB,64MiB]
       [--protocols tcp,shm] [--repeat 5] [--duration 1] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from functools import partial
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # tests.support.standin_device for the CPU stand-in


def parse_size(s: str) -> int:
    from kvplane.common.config import parse_size as ps
    return int(ps(s))


def _target(conn: Any, protocol: str, nbytes: int) -> None:
    from kvplane.transfer import EngineConfig, TransferEngine

    te = TransferEngine(EngineConfig(host="127.0.0.1", metadata="P2PHANDSHAKE", protocol=protocol))
    buf = np.zeros(nbytes, np.uint8)
    te.register_memory(buf)
    conn.send((te.name, int(buf.ctypes.data)))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        off, n = msg
        conn.send(hashlib.sha256(buf[off:off + n].tobytes()).hexdigest())
    te.close()


class Device:
    """A device buffer of ``nbytes``: CUDA through torch, or the stand-in."""

    def __init__(self, name: str, nbytes: int) -> None:
        self.name, self.nbytes = name, nbytes
        if name.startswith("cuda"):
            import torch
            self.torch = torch
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=name)
            self.addr = int(self.tensor.data_ptr())
            self.obj: Any = self.tensor
        else:
            from tests.support.standin_device import StandinDevice
            self.dev = StandinDevice(name)
            self.addr = self.dev.alloc(nbytes)
            self.obj = (self.addr, nbytes)

    def fill(self, data: bytes) -> None:
        if self.name.startswith("cuda"):
            src = self.torch.frombuffer(bytearray(data), dtype=self.torch.uint8)
            self.tensor[:len(data)].copy_(src)
            self.torch.cuda.synchronize()
        else:
            self.dev.write(self.addr, data)

    def digest(self, n: int) -> str:
        if self.name.startswith("cuda"):
            return hashlib.sha256(self.tensor[:n].cpu().numpy().tobytes()).hexdigest()
        return self.dev.digest(self.addr, n)

    def register(self, te: Any) -> None:
        if self.name.startswith("cuda"):
            te.register_memory(self.obj)
        else:
            te.register_memory(self.obj, device=self.name)

    def copier(self) -> Any:
        from kvplane.transfer.device import MemRegion, copier_for
        tensor = self.tensor if self.name.startswith("cuda") else None
        return copier_for([MemRegion(self.addr, self.nbytes, self.name, tensor)])


def timed(fn: Any, size: int, duration: float, min_calls: int = 3) -> float:
    """GB/s of ``fn`` (moving ``size`` bytes per call) over about ``duration`` seconds."""
    fn()  # warm
    n, t0 = 0, time.perf_counter()
    while n < min_calls or time.perf_counter() - t0 < duration:
        fn()
        n += 1
    return n * size / (time.perf_counter() - t0) / 1e9


def copy_alone(copier: Any, dev_addr: int, size: int, chunk: int, to_device: bool,
               slots: list[Any]) -> None:
    """``size`` bytes through the staging slots, one chunk per slot, two in flight (as the
    engine's pipeline copies)."""
    from kvplane.transfer.device import Copy
    pending: list[Any] = []
    for i, off in enumerate(range(0, size, chunk)):
        n = min(chunk, size - off)
        slot = slots[i % len(slots)]
        mv = Copy(slot.addr, dev_addr + off, n) if to_device else Copy(dev_addr + off, slot.addr, n)
        pending.append(copier.copy([mv], to_device))
        if len(pending) >= len(slots):
            pending.pop(0).wait(30.0)
    for f in pending:
        f.wait(30.0)


def _move(te: Any, handle: int, raddr: int, op: str, local: int, size: int) -> None:
    from kvplane.transfer import TransferStatus

    call = te.write_one if op == "write" else te.read_one
    st = call(handle, local, raddr, size, timeout=60)
    if st != TransferStatus.COMPLETED:
        raise RuntimeError(f"{op} of {size} bytes: {st}")


def run(a: argparse.Namespace) -> list[dict[str, Any]]:
    from kvplane.transfer import EngineConfig, TransferEngine

    sizes = [parse_size(s) for s in a.sizes.split(",")]
    biggest = max(sizes)
    chunk = parse_size(a.chunk)
    rows: list[dict[str, Any]] = []
    ctx = mp.get_context("spawn")
    for protocol in a.protocols.split(","):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_target, args=(child, protocol, biggest), daemon=True)
        proc.start()
        try:
            if not parent.poll(60):
                raise RuntimeError("target did not start")
            seg, raddr = parent.recv()
            te = TransferEngine(EngineConfig(host="127.0.0.1", metadata="P2PHANDSHAKE",
                                             protocol=protocol, device_chunk=chunk,
                                             device_slots=a.slots))
            dev = Device(a.device, biggest)
            dev.register(te)
            host = np.zeros(biggest, np.uint8)
            te.register_memory(host)
            handle = te.open_segment(seg, timeout=10)
            copier = dev.copier()
            slots = [copier.host_buffer(chunk) for _ in range(2)]
            pattern = np.random.default_rng(1).integers(0, 256, biggest, np.uint8).tobytes()
            dev.fill(pattern)
            host[:] = np.frombuffer(pattern, np.uint8)

            move = partial(_move, te, handle, raddr)
            for size in sizes:
                # correctness once per cell: device -> remote, remote -> device
                move("write", dev.addr, size)
                parent.send((0, size))
                if parent.recv() != hashlib.sha256(pattern[:size]).hexdigest():
                    raise RuntimeError("staged write: remote bytes differ")
                dev.fill(bytes(size))
                move("read", dev.addr, size)
                if dev.digest(size) != hashlib.sha256(pattern[:size]).hexdigest():
                    raise RuntimeError("staged read: device bytes differ")
                cells: dict[tuple[str, str], list[float]] = {}
                for _ in range(a.repeat):  # sides interleaved within each round
                    for op in ("write", "read"):
                        to_dev = op == "read"
                        sides = {"copy": partial(copy_alone, copier, dev.addr, size, chunk,
                                                 to_dev, slots),
                                 "host": partial(move, op, int(host.ctypes.data), size),
                                 "staged": partial(move, op, dev.addr, size)}
                        for side, fn in sides.items():
                            cells.setdefault((side, op), []).append(timed(fn, size, a.duration))
                for op in ("write", "read"):
                    med = {k: statistics.median(cells[(k, op)]) for k in ("copy", "host", "staged")}
                    rows.append({"device": a.device, "protocol": protocol, "op": op, "size": size,
                                 "chunk": chunk, "copy_gb_s": med["copy"], "host_gb_s": med["host"],
                                 "staged_gb_s": med["staged"],
                                 "staged_min": min(cells[("staged", op)]),
                                 "staged_max": max(cells[("staged", op)]),
                                 "vs_copy": med["staged"] / med["copy"],
                                 "vs_ideal": med["staged"] / min(med["copy"], med["host"]),
                                 "runs": a.repeat, "verified": True})
            te.close()
        finally:
            parent.send(None)
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cuda:N, or standin (default: cuda:0 when "
                    "torch sees a GPU, else standin:0)")
    ap.add_argument("--sizes", default="4MiB,64MiB")
    ap.add_argument("--protocols", default="tcp,shm")
    ap.add_argument("--chunk", default="4MiB", help="EngineConfig.device_chunk")
    ap.add_argument("--slots", type=int, default=4, help="EngineConfig.device_slots")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--duration", type=float, default=1.0, help="seconds per side and round")
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    a = ap.parse_args(argv)
    if a.device is None:
        try:
            import torch
            a.device = "cuda:0" if torch.cuda.is_available() else "standin:0"
        except ImportError:
            a.device = "standin:0"
    elif a.device == "standin":
        a.device = "standin:0"
    rows = run(a)
    for r in rows:
        if a.json:
            print(json.dumps(r))
        else:
            print(f"{r['device']:10} {r['protocol']:4} {r['op']:5} {r['size'] >> 20:5} MiB  "
                  f"copy {r['copy_gb_s']:6.2f}  host {r['host_gb_s']:6.2f}  staged "
                  f"{r['staged_gb_s']:6.2f} GB/s  staged/copy {r['vs_copy']:.2f}  "
                  f"staged/min(copy,host) {r['vs_ideal']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
