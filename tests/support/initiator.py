"""A transfer-engine initiator process for tests: moves bytes to a target on command, so a
transport whose library may crash at exit (NIXL/UCX) never runs inside pytest.

Prints one JSON ready line, then answers one JSON line per command on stdin:

    open SEGMENT                        -> {"handle": H}
    read H RADDR N [TIMEOUT] [GEN]      -> {"status": [...], "errors": [...], "secs": S,
                                            "pattern_ok": bool}  (read into offset 0)
    batch H RADDR COUNT SIZE [TIMEOUT]  -> COUNT reads of SIZE, item i from RADDR+(COUNT-1-i)*SIZE
    write H RADDR N BYTE [TIMEOUT] [GEN]-> fills N local bytes with BYTE and writes them
    oneread H RADDR N [TIMEOUT] [LOFF]  -> as read, by ``transfer_one`` into offset LOFF; also
                                            "resolved": the routes it resolved so far
    onewrite H RADDR N BYTE [TIMEOUT]   -> as write, by ``transfer_one``
    lists                               -> {"prepared": P, "local": [[BASE, BLOCK]...],
                                            "remote": [[BASE, BLOCK]...], "base": B}: the nixl
                                            transport's prepared descriptor lists
    reregister                          -> unregisters the local buffer and registers it again
    cpu SECONDS                         -> {"cpu": S}: this process's CPU seconds while idle

    python -m tests.support.initiator [--protocol P] [--buf-mb M]

``pattern_ok``: the bytes read equal ``tests.support.target.pattern`` at their remote offset
(RADDR minus the target's base, passed as ``--base``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from kvplane.common.procs import Proc
from kvplane.transfer import EngineConfig, OpCode, TransferEngine, TransferRequest
from kvplane.transfer.transports.nixl import NixlTransport
from tests.support.target import pattern

NIXL_TRANSPORTS = "tcp,shm,file,local,nixl"


def nixl_env(ucx_tls: str = "") -> dict[str, str]:
    """The environment of a child engine that loads the nixl transport (``ucx_tls``: UCX's
    transports, "" for UCX's own choice)."""
    env = {"KVPLANE_NIXL": "on", "KVPLANE_TRANSPORTS": NIXL_TRANSPORTS}
    if ucx_tls:
        env["UCX_TLS"] = ucx_tls
    return env


def spawn_initiator(*args: str, env: dict[str, str] | None = None) -> Proc:
    """Start ``python -m tests.support.initiator ARGS`` and wait for its ready line."""
    return Proc([sys.executable, "-m", "tests.support.initiator", *args], env=env)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--protocol", default="auto")
    ap.add_argument("--buf-mb", type=int, default=16)
    ap.add_argument("--base", type=int, default=0, help="the target buffer's address")
    a = ap.parse_args(argv)
    te = TransferEngine(EngineConfig.from_env(protocol=a.protocol))
    buf = np.zeros(a.buf_mb << 20, np.uint8)
    te.register_memory(buf)
    base = int(buf.ctypes.data)
    print(json.dumps({"pid": os.getpid(), "transports": sorted(te.transports)}), flush=True)
    for line in sys.stdin:
        p = line.split()
        if not p:
            continue
        if p[0] == "open":
            print(json.dumps({"handle": te.open_segment(p[1])}), flush=True)
            continue
        if p[0] in ("lists", "reregister", "cpu"):
            print(json.dumps(_inspect(te, buf, p)), flush=True)
            continue
        if p[0] in ("oneread", "onewrite"):
            print(json.dumps(_one(te, buf, p, a.base)), flush=True)
            continue
        h, raddr = int(p[1]), int(p[2])
        if p[0] == "batch":
            count, size = int(p[3]), int(p[4])
            timeout = float(p[5]) if len(p) > 5 else 10.0
            reqs = [TransferRequest(OpCode.READ, base + i * size, h,
                                    raddr + (count - 1 - i) * size, size) for i in range(count)]
            expect = [(i * size, size, raddr - a.base + (count - 1 - i) * size)
                      for i in range(count)]
        else:
            n = int(p[3])
            rest = p[4:] if p[0] == "read" else p[5:]
            timeout = float(rest[0]) if rest else 10.0
            gen = int(rest[1]) if len(rest) > 1 else 0
            if p[0] == "write":
                buf[:n] = int(p[4])
            op = OpCode.READ if p[0] == "read" else OpCode.WRITE
            reqs = [TransferRequest(op, base, h, raddr, n, gen=gen)]
            expect = [(0, n, raddr - a.base)] if op == OpCode.READ else []
        bid = te.allocate_batch(len(reqs))
        t0 = time.monotonic()
        te.submit(bid, reqs, timeout)
        statuses = te.wait(bid, timeout + 30)  # the transfer's own deadline is ``timeout``
        secs = time.monotonic() - t0
        errors = te.errors(bid)
        te.free_batch(bid)
        print(json.dumps({"status": [s.name for s in statuses], "errors": errors, "secs": secs,
                          "pattern_ok": bool(expect) and all(
                              np.array_equal(buf[at:at + k], pattern(k, off))
                              for at, k, off in expect)}), flush=True)
    te.close()
    return 0


def _one(te: TransferEngine, buf: np.ndarray, p: list[str], tbase: int) -> dict:
    """``oneread``/``onewrite``: one request through ``TransferEngine.transfer_one``."""
    h, raddr, n = int(p[1]), int(p[2]), int(p[3])
    rest = p[4:] if p[0] == "oneread" else p[5:]
    timeout = float(rest[0]) if rest else 10.0
    at = int(rest[1]) if len(rest) > 1 else 0
    if p[0] == "onewrite":
        buf[:n] = int(p[4])
    op = OpCode.READ if p[0] == "oneread" else OpCode.WRITE
    t0 = time.monotonic()
    st = te.transfer_one(op, int(buf.ctypes.data) + at, h, raddr, n, timeout=timeout)
    secs = time.monotonic() - t0
    ok = op == OpCode.READ and np.array_equal(buf[at:at + n], pattern(n, raddr - tbase))
    return {"status": [st.name], "secs": secs, "pattern_ok": bool(ok),
            "resolved": te._router.resolved}


def _inspect(te: TransferEngine, buf: np.ndarray, p: list[str]) -> dict:
    """The commands that look at (or re-register) this engine rather than move bytes."""
    if p[0] == "reregister":
        te.unregister_memory(int(buf.ctypes.data))
        te.register_memory(buf)
        return {"ok": True}
    if p[0] == "cpu":
        t0 = os.times()
        time.sleep(float(p[1]))
        t1 = os.times()
        return {"cpu": t1.user - t0.user + t1.system - t0.system}
    nixl = te.transports["nixl"]
    assert isinstance(nixl, NixlTransport)  # (the commands above run over nixl only)
    lists = nixl.lists
    held = lists.held()
    return {"prepared": lists.prepared, "base": int(buf.ctypes.data),
            "local": [[k[1], k[2]] for k in held if k[0] == "NIXL_INIT_AGENT"],
            "remote": [[k[1], k[2]] for k in held if k[0] != "NIXL_INIT_AGENT"]}


if __name__ == "__main__":
    sys.exit(main())
