"""A transfer-engine target process for tests and benchmarks.

Registers a buffer filled with ``i % 251`` (so reads can be verified), prints one JSON line
with everything a peer needs, then serves until stdin closes (the parent died or let go).

    python -m tests.support.target --buf-mb 16 [--managed|--fenced] [--metadata URL] [--name N]

Commands on stdin: ``sum OFFSET N`` (a checksum of our own memory), ``epoch E`` (serve store
epoch E: the fence floor moves up), ``extra M`` (register another M MiB buffer: the published
regions, and a one-sided fabric's advert, change).

With ``--standin-mb M`` it also registers M MiB of stand-in device memory
(``tests.support.standin_device``, raw ``(addr, length)`` with ``device="standin:0"``) holding
the same pattern, served through the listener's device staging (chunks of
``--device-chunk``); ``dev_addr`` in the ready line. Commands: ``dsum OFFSET N`` (a checksum
of the device bytes), ``dfail KIND SKIP`` (the stand-in's next batch of KIND ``to_host`` or
``to_device`` after SKIP more fails at its fence); with ``--standin-threaded`` its copies run
on a worker thread and ``dstall on|off`` holds or releases them (a stalled device).
``dinfo``: the stand-in's batch counts and armed failures. ``--cuda-mb M`` registers a CUDA
tensor of M MiB holding the pattern (``cuda_addr``; ``csum OFFSET N`` checksums it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

import numpy as np

from kvplane.common.procs import Proc
from kvplane.transfer import EngineConfig, TransferEngine


def pattern(n: int, offset: int = 0) -> np.ndarray:
    """The bytes a target holds at [offset, offset+n)."""
    return ((np.arange(offset, offset + n, dtype=np.int64)) % 251).astype(np.uint8)


def spawn_target(*args: str, env: dict[str, str] | None = None) -> Proc:
    """Start ``python -m tests.support.target ARGS`` and wait for its ready line."""
    return Proc([sys.executable, "-m", "tests.support.target", *args], env=env)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--buf-mb", type=int, default=16)
    ap.add_argument("--managed", action="store_true")
    ap.add_argument("--fenced", action="store_true", help="a managed buffer whose first 8 bytes "
                    "hold the fence floor (command: epoch E)")
    ap.add_argument("--metadata", default="P2PHANDSHAKE")
    ap.add_argument("--name", default=None)
    ap.add_argument("--protocol", default="auto")
    ap.add_argument("--token", default="")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--file-root", default="")
    ap.add_argument("--file", default="", help="also register a file region NAME:SIZE")
    ap.add_argument("--standin-mb", type=int, default=0)
    ap.add_argument("--device-chunk", type=int, default=4 << 20)
    ap.add_argument("--standin-threaded", action="store_true")
    ap.add_argument("--cuda-mb", type=int, default=0)
    a = ap.parse_args(argv)
    cfg = EngineConfig.from_env(metadata=a.metadata, name=a.name, protocol=a.protocol,
                                token=a.token, port=a.port, file_root=a.file_root,
                                republish_interval=0.2, device_chunk=a.device_chunk)
    te = TransferEngine(cfg)
    n = a.buf_mb << 20
    if a.managed or a.fenced:
        buf = te.allocate_managed_buffer(n, fenced=a.fenced)
        arr = buf.array
    else:
        arr = np.empty(n, np.uint8)
        te.register_memory(arr)
    arr[:] = pattern(n)
    info = {"segment": te.name, "pid": os.getpid(), "port": te.port, "addr": int(arr.ctypes.data), "size": n}
    if a.file:
        fname, fsize = a.file.split(":")
        region = te.register_file(fname, int(fsize))
        info["file_addr"] = region.addr
    dev = None
    if a.standin_mb:
        from tests.support.standin_device import StandinDevice
        dev = StandinDevice("standin:0", threaded=a.standin_threaded)
        dn = a.standin_mb << 20
        info["dev_addr"] = dev_addr = dev.alloc(dn)
        dev.write(dev_addr, pattern(dn).tobytes())
        te.register_memory((dev_addr, dn), device="standin:0")
    cuda = None
    if a.cuda_mb:
        import torch
        cuda = torch.from_numpy(pattern(a.cuda_mb << 20)).cuda()
        te.register_memory(cuda)
        info["cuda_addr"] = int(cuda.data_ptr())
    print(json.dumps(info), flush=True)
    extra: list[np.ndarray] = []
    for line in sys.stdin:  # commands: "sum OFFSET N" prints a checksum of our own memory
        parts = line.split()
        if parts and parts[0] == "dsum" and dev is not None:
            got = np.frombuffer(dev.read(info["dev_addr"] + int(parts[1]), int(parts[2])), np.uint8)
            print(json.dumps({"sum": int(got.sum(dtype=np.uint64))}), flush=True)
        elif parts and parts[0] == "dfail" and dev is not None:
            dev.skip[parts[1]] = int(parts[2])
            setattr(dev, f"fail_{parts[1]}", 1)
            print(json.dumps({"armed": parts[1]}), flush=True)
        elif parts and parts[0] == "csum" and cuda is not None:
            off, cnt = int(parts[1]), int(parts[2])
            got = cuda[off:off + cnt].cpu().numpy()
            print(json.dumps({"sum": int(got.sum(dtype=np.uint64))}), flush=True)
        elif parts and parts[0] == "dinfo" and dev is not None:
            print(json.dumps({"batches": dev.batches, "fail_to_host": dev.fail_to_host,
                              "fail_to_device": dev.fail_to_device}), flush=True)
        elif parts and parts[0] == "dstall" and dev is not None:
            if parts[1] == "on":
                dev.stall = threading.Event()
            elif dev.stall is not None:
                dev.stall.set()
            print(json.dumps({"stall": parts[1]}), flush=True)
        elif parts and parts[0] == "sum":
            off, cnt = int(parts[1]), int(parts[2])
            print(json.dumps({"sum": int(arr[off:off + cnt].sum(dtype=np.uint64))}), flush=True)
        elif parts and parts[0] == "extra":
            extra.append(np.zeros(int(parts[1]) << 20, np.uint8))
            te.register_memory(extra[-1])
            print(json.dumps({"addr": int(extra[-1].ctypes.data)}), flush=True)
        elif parts and parts[0] == "epoch":
            te.fence.set_epoch(int(parts[1]))
            print(json.dumps({"floor": te.fence.floor}), flush=True)
    te.close()
    if dev is not None:
        dev.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
