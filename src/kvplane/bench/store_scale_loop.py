"""Load worker of ``benchmarks/store_scale.py cpu|cold|bytes``: one client process, one op.

Runs under kvplane's interpreter (``--impl kvplane``: ``kvplane.compat.mooncake``) or Mooncake's
(``--impl mooncake``: the real ``mooncake.store``); imports nothing from kvplane otherwise.
Protocol on stdin/stdout, one JSON line each way, so the driver can start every client's
measured phase at once and read the master's CPU time around it exactly:

1. the worker sets up, preloads ``--keys`` keys (ops that read) and prints ``{"ready": true}``;
2. the driver writes ``go``; the worker runs ``--op`` for ``--duration`` seconds and prints
   ``{"ops": N, "calls": C, "elapsed": s, "lat": [ns...], "ok": bool}``;
3. the driver writes ``quit`` (or closes stdin); the worker removes its keys and exits.

Ops: ``exists`` (``is_exist``), ``get`` and ``getinto`` (``get_into``), ``put`` (``put_from``
of fresh keys), ``bget32`` / ``bput32`` (``batch_get_into`` / ``batch_put_from`` of 32 keys),
``getb`` (the copying ``get(key)`` returning bytes, each checked against the value put),
``fill`` (puts the keys and stops: another process reads them) and ``cold`` (``get_into`` of
the keys a ``fill`` worker with the same ``--prefix`` put, each once: keys this client never
read), ``coldx`` (the same keys, each an ``is_exist`` and then the ``get_into``, timed
together).
``--rate`` paces the calls (calls per second of this client; 0: as fast as it can).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

BATCH = 32


def _store(impl: str, a: argparse.Namespace) -> Any:
    if impl == "mooncake":
        from mooncake.store import MooncakeDistributedStore
    else:
        from kvplane.compat.mooncake import MooncakeDistributedStore
    st = MooncakeDistributedStore()
    rc = st.setup("127.0.0.1", a.metadata, 0, a.local_buffer_mb << 20, a.protocol, "", a.master)
    if rc != 0:
        raise RuntimeError(f"setup rc={rc}")
    return st


def _send(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class Load:
    """The store, its registered buffers and the keys one op needs."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.st = _store(a.impl, a)
        n = max(a.size * BATCH, a.size)
        self.tx = np.random.default_rng(a.seed).integers(0, 256, n, dtype=np.uint8)
        self.rx = np.zeros(n, np.uint8)
        for arr in (self.tx, self.rx):
            if self.st.register_buffer(arr.ctypes.data, arr.nbytes) != 0:
                raise RuntimeError("register_buffer failed")
        self.txp, self.rxp = self.tx.ctypes.data, self.rx.ctypes.data
        self.keys = [f"{a.prefix}-{i}" for i in range(a.keys)]
        self.put_keys: list[str] = []
        self.values: list[bytes] = []
        if a.op in ("exists", "get", "bget32", "getb", "getinto", "fill"):
            self._preload()

    def _preload(self) -> None:
        a = self.a
        if a.op == "getb":  # distinct values, so a wrong key's bytes are caught
            for i, k in enumerate(self.keys):
                v = self.tx[:a.size].copy()
                v[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
                self.values.append(v.tobytes())
                if self.st.put(k, self.values[-1]) != 0:
                    raise RuntimeError(f"preload put {k} failed")
            return
        for i in range(0, len(self.keys), BATCH):
            ks = self.keys[i:i + BATCH]
            rs = self.st.batch_put_from(ks, [self.txp] * len(ks), [a.size] * len(ks))
            if any(r != 0 for r in rs):
                raise RuntimeError(f"preload failed: {sorted(set(rs))}")

    def call(self, i: int) -> int:
        """One call of the op; returns the objects it touched (raises on a failure)."""
        a, st, n = self.a, self.st, len(self.keys)
        op = a.op
        if op == "exists":
            if st.is_exist(self.keys[i % n]) != 1:
                raise RuntimeError(f"is_exist {self.keys[i % n]} != 1")
            return 1
        if op == "fill":
            raise EOFError
        if op == "coldx":  # exists, then the get: the pattern of an engine's connector
            if i >= n:
                raise EOFError
            if st.is_exist(self.keys[i]) != 1:
                raise RuntimeError(f"is_exist {self.keys[i]} != 1")
            op = "cold"
        if op in ("get", "cold", "getinto"):
            if op == "cold" and i >= n:
                raise EOFError
            got = st.get_into(self.keys[i % n], self.rxp, a.size)
            if got != a.size:
                raise RuntimeError(f"get_into {self.keys[i % n]} = {got}")
            return 1
        if op == "getb":
            j = i % n
            if st.get(self.keys[j]) != self.values[j]:
                raise RuntimeError(f"get {self.keys[j]}: wrong bytes")
            return 1
        if op == "put":
            k = f"{a.prefix}-p{i}"
            self.put_keys.append(k)
            if st.put_from(k, self.txp, a.size) != 0:
                raise RuntimeError(f"put_from {k} failed")
            return 1
        if op == "bget32":
            j = (i * BATCH) % max(n - BATCH + 1, 1)
            ks = self.keys[j:j + BATCH]
            rs = st.batch_get_into(ks, [self.rxp + x * a.size for x in range(len(ks))],
                                   [a.size] * len(ks))
            if any(r != a.size for r in rs):
                raise RuntimeError(f"batch_get_into: {sorted(set(rs))}")
            return len(ks)
        if op == "bput32":
            ks = [f"{a.prefix}-p{i}-{x}" for x in range(BATCH)]
            self.put_keys += ks
            rs = st.batch_put_from(ks, [self.txp + x * a.size for x in range(BATCH)],
                                   [a.size] * BATCH)
            if any(r != 0 for r in rs):
                raise RuntimeError(f"batch_put_from: {sorted(set(rs))}")
            return BATCH
        raise ValueError(f"unknown op {op}")

    def run(self) -> dict:
        a = self.a
        lat: list[int] = []
        ops = calls = 0
        gap = 1.0 / a.rate if a.rate > 0 else 0.0
        t0 = time.perf_counter()
        end = t0 + a.duration
        ok = True
        err = ""
        while True:
            now = time.perf_counter()
            if now >= end:
                break
            if gap:  # paced: the i-th call starts no earlier than t0 + i * gap
                due = t0 + calls * gap
                if due > now:
                    time.sleep(due - now)
            x = time.perf_counter_ns()
            try:
                ops += self.call(calls)
            except EOFError:
                break
            except Exception as exc:  # reported, the driver fails the run
                ok, err = False, repr(exc)
                break
            lat.append(time.perf_counter_ns() - x)
            calls += 1
        el = time.perf_counter() - t0
        if ok and calls and a.op in ("get", "getinto", "bget32", "cold", "coldx"):  # as put
            ok = bool(np.array_equal(self.rx[:a.size], self.tx[:a.size]))
            err = "" if ok else "wrong bytes"
        return {"ops": ops, "calls": calls, "elapsed": el, "lat": lat, "ok": ok, "error": err,
                "shm_mapped": self._mapped()}

    def _mapped(self) -> int:
        """kvplane: segments whose shared memory this client maps (0 over TCP)."""
        engine = getattr(getattr(getattr(self.st, "_c", None), "context", None), "engine", None)
        shm = engine.transports.get("shm") if engine is not None else None
        return len(shm.mapped()) if shm is not None else 0

    def close(self) -> None:
        for group in ([] if self.a.op in ("cold", "coldx") else self.keys, self.put_keys):
            for i in range(0, len(group), 512):
                self.st.batch_remove(group[i:i + 512], True)
        self.st.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", choices=["kvplane", "mooncake"], required=True)
    ap.add_argument("--master", required=True)
    ap.add_argument("--metadata", default="P2PHANDSHAKE")
    ap.add_argument("--protocol", default="tcp", help="transfer protocol of setup()")
    ap.add_argument("--op", required=True)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--keys", type=int, default=1024)
    ap.add_argument("--duration", type=float, default=2.0)
    ap.add_argument("--rate", type=float, default=0.0, help="calls/s of this client (0: unpaced)")
    ap.add_argument("--prefix", default="scale")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--local-buffer-mb", type=int, default=64)
    a = ap.parse_args(argv)
    load = Load(a)
    _send({"ready": True})
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "go":
            _send(load.run())
        elif cmd == "quit":
            break
    load.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
