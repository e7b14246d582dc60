"""Standalone store benchmark worker: one client process measuring put/get loops.

``--impl kvplane`` uses ``kvplane.compat.mooncake.MooncakeDistributedStore``, ``--impl mooncake``
the real ``mooncake.store`` (run it with Mooncake's interpreter), ``--impl redis`` redis-py
against a Redis server. The same loop measures all three. Single ops are
``put_from``/``get_into`` (Redis: SET/GET); batches are ``batch_put_from``/``batch_get_into``
(Redis: a pipeline of SET/GET). With ``--api bytes`` the Mooncake APIs' copying calls instead:
``put``/``get`` returning bytes, ``put_batch``/``get_batch`` (every value read is compared
with the one put). ``--working-set-mb``: the get phase cycles over exactly that many bytes of
keys per client (the put phase's keys, topped up off the clock), e.g. more than the CPU
caches hold. Prints one JSON object per cell. Imports nothing from kvplane unless
``--impl kvplane``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from typing import cast

import numpy as np


class StoreImpl:
    """put(keys, ptrs, sizes) / get(keys, ptrs, sizes) -> bool over a Mooncake-API store."""

    def __init__(self, impl: str, a: argparse.Namespace, tx: np.ndarray, rx: np.ndarray) -> None:
        if impl == "mooncake":
            from mooncake.store import MooncakeDistributedStore
        else:
            from kvplane.compat.mooncake import MooncakeDistributedStore
        self.st = MooncakeDistributedStore()
        rc = self.st.setup("127.0.0.1", a.metadata, a.segment_mb << 20, a.local_buffer_mb << 20,
                           a.protocol, "", a.master)
        if rc != 0:
            raise RuntimeError(f"setup rc={rc}")
        for arr in (tx, rx):
            if self.st.register_buffer(arr.ctypes.data, arr.nbytes) != 0:
                raise RuntimeError("register_buffer failed")
        self.tx, self.rx = tx.ctypes.data, rx.ctypes.data
        self.txv = tx.data
        self.bytes_api = a.api == "bytes"

    def put(self, keys: list[str], size: int) -> bool:
        if self.bytes_api:
            vals = [self.txv[j * size:(j + 1) * size] for j in range(len(keys))]
            rs = [self.st.put(keys[0], vals[0])] if len(keys) == 1 else \
                [self.st.put_batch(keys, vals)]
            self.last = rs
            return all(r == 0 for r in rs)
        if len(keys) == 1:
            rs = [self.st.put_from(keys[0], self.tx, size)]
        else:
            rs = self.st.batch_put_from(keys, [self.tx + j * size for j in range(len(keys))],
                                        [size] * len(keys))
        self.last = rs
        return all(r == 0 for r in rs)

    def get(self, keys: list[str], size: int) -> bool:
        if self.bytes_api:  # a new bytes object per key, as Mooncake-API users get
            got = [self.st.get(keys[0])] if len(keys) == 1 else self.st.get_batch(keys)
            self.last = [len(v) for v in got]
            return all(v == self.txv[j * size:(j + 1) * size] for j, v in enumerate(got))
        if len(keys) == 1:
            rs = [self.st.get_into(keys[0], self.rx, size)]
        else:
            rs = self.st.batch_get_into(keys, [self.rx + j * size for j in range(len(keys))],
                                        [size] * len(keys))
        self.last = rs
        return all(r == size for r in rs)

    def remove(self, keys: list[str]) -> None:
        self.st.batch_remove(keys, True)

    def close(self) -> None:
        self.st.close()


class RedisImpl:
    """The same interface over redis-py (one connection; batches are pipelines)."""

    def __init__(self, a: argparse.Namespace, tx: np.ndarray, rx: np.ndarray) -> None:
        import redis

        host, port = a.master.rsplit(":", 1)
        self.r = redis.Redis(host=host, port=int(port), socket_timeout=30)
        self.txv, self.rx = tx.data, rx

    def put(self, keys: list[str], size: int) -> bool:
        if len(keys) == 1:
            return bool(self.r.set(keys[0], self.txv[:size]))
        p = self.r.pipeline(transaction=False)
        for j, k in enumerate(keys):
            p.set(k, self.txv[j * size:(j + 1) * size])
        return all(p.execute())

    def get(self, keys: list[str], size: int) -> bool:
        if len(keys) == 1:
            v = cast(bytes, self.r.get(keys[0]))  # no decode_responses: bytes (None: a miss, a failure)
            self.rx[:size] = np.frombuffer(v, np.uint8)
            return len(v) == size
        p = self.r.pipeline(transaction=False)
        for k in keys:
            p.get(k)
        vals = p.execute()
        for j, v in enumerate(vals):
            self.rx[j * size:(j + 1) * size] = np.frombuffer(v, np.uint8)
        return all(len(v) == size for v in vals)

    def remove(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 512):
            self.r.delete(*keys[i:i + 512])

    def close(self) -> None:
        self.r.close()


class _Op:
    """impl.put/get for one size; remembers the last return codes for error messages."""

    def __init__(self, impl, op: str, size: int) -> None:
        self.fn, self.size, self.impl = getattr(impl, op), size, impl

    def __call__(self, keys: list[str]) -> bool:
        return bool(self.fn(keys, self.size))

    def last_codes(self) -> list:
        return sorted(set(map(str, getattr(self.impl, "last", []))))


def _pct(v: list[int], q: float) -> float:
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))] / 1e3 if v else float("nan")


def _phase(fn, keys_for, duration: float, min_calls: int):
    lat: list[int] = []
    t0 = time.perf_counter()
    i = 0
    while (time.perf_counter() - t0 < duration or len(lat) < min_calls):
        keys = keys_for(i)
        if keys is None:
            break
        x = time.perf_counter_ns()
        if not fn(keys):
            raise RuntimeError(f"operation failed on {keys[0]} (call {i}): codes {fn.last_codes()}")
        lat.append(time.perf_counter_ns() - x)
        i += 1
    return lat, time.perf_counter() - t0


def client(cid: int, a: argparse.Namespace, barrier, q) -> None:
    try:
        sizes = [int(s) for s in a.sizes.split(",")]
        batches = [int(b) for b in str(a.batch).split(",")]
        tx = np.resize(np.random.default_rng(cid).integers(0, 256, 1 << 20, dtype=np.uint8),
                       max(sizes) * max(batches))
        rx = np.zeros_like(tx)
        impl = RedisImpl(a, tx, rx) if a.impl == "redis" else StoreImpl(a.impl, a, tx, rx)
        pfx = f"{a.label}-{cid}-{os.getpid()}"
        for size in sizes:
            for k in (1, *batches):
                cap = max(k, (a.cap_mb << 20) // size // k * k)
                live: list[str] = []
                barrier.wait(120)

                def put_keys(i: int) -> list[str] | None:
                    keys = [f"{pfx}-{size}-{k}-{i}-{j}" for j in range(k)]  # noqa: B023  (called now)
                    live.extend(keys)  # noqa: B023  (called in this iteration)
                    return keys if len(live) <= cap else None  # noqa: B023  (called in this iteration)

                put_fn = _Op(impl, "put", size)
                lat, el = _phase(put_fn, put_keys, a.duration, a.min_calls)
                q.put(dict(op="put", size=size, batch=k, calls=len(lat), elapsed=el, lat=lat, cid=cid))
                live = live[:len(lat) * k]
                if a.working_set_mb:  # exactly this many bytes of keys, topped up unmeasured
                    want = max(k, (a.working_set_mb << 20) // size // k * k)
                    i = len(lat)
                    while len(live) < want:
                        more = [f"{pfx}-{size}-{k}-{i}-{j}" for j in range(k)]
                        if not put_fn(more):
                            raise RuntimeError(f"top-up put of {more[0]} failed")
                        live += more
                        i += 1
                    impl.remove(live[want:])
                    live = live[:want]
                n = len(live) // k
                barrier.wait(120)
                lat, el = _phase(_Op(impl, "get", size),
                                 lambda i: live[(i % n) * k:(i % n + 1) * k], a.duration, a.min_calls)  # noqa: B023  (called now)
                ok = a.api == "bytes" or bool(  # (the bytes API compares every value itself)
                    np.array_equal(rx[(k - 1) * size:k * size], tx[(k - 1) * size:k * size]))
                q.put(dict(op="get", size=size, batch=k, calls=len(lat), elapsed=el, lat=lat,
                           cid=cid, verified=ok))
                impl.remove(live)
        impl.close()
        q.put({"done": cid})
    except BaseException as exc:  # report, then let the driver fail the run
        q.put({"error": f"client {cid}: {exc!r}"})
        barrier.abort()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--impl", choices=["kvplane", "mooncake", "redis"], required=True)
    ap.add_argument("--label", default=None)
    ap.add_argument("--master", required=True, help="master (or Redis) host:port")
    ap.add_argument("--metadata", default="P2PHANDSHAKE")
    ap.add_argument("--protocol", default="tcp")
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--segment-mb", type=int, default=0, help="memory each client contributes")
    ap.add_argument("--local-buffer-mb", type=int, default=64)
    ap.add_argument("--sizes", default="4096,65536,1048576,16777216")
    ap.add_argument("--batch", default="32", help="objects per batch call, comma separated")
    ap.add_argument("--duration", type=float, default=1.0)
    ap.add_argument("--min-calls", type=int, default=3)
    ap.add_argument("--cap-mb", type=int, default=256)
    ap.add_argument("--api", choices=["zero-copy", "bytes"], default="zero-copy",
                    help="zero-copy: put_from/get_into; bytes: put/get returning bytes")
    ap.add_argument("--working-set-mb", type=int, default=0,
                    help="bytes of keys the get phase cycles over, per client (0: what the put "
                         "phase put, at most --cap-mb)")
    a = ap.parse_args(argv)
    a.label = a.label or a.impl
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    barrier = ctx.Barrier(a.clients)
    procs = [ctx.Process(target=client, args=(i, a, barrier, q), daemon=True) for i in range(a.clients)]
    for p in procs:
        p.start()
    cells: dict[tuple, list[dict]] = {}
    done = 0
    while done < a.clients:
        m = q.get(timeout=600)
        if "error" in m:
            print(m["error"], file=sys.stderr)
            for p in procs:
                p.kill()
            return 1
        if "done" in m:
            done += 1
            continue
        cells.setdefault((m["op"], m["size"], m["batch"]), []).append(m)
    for (op, size, k), ms in cells.items():
        lat = sorted(x for m in ms for x in m["lat"])
        el = max(m["elapsed"] for m in ms)
        objs = sum(m["calls"] for m in ms) * k
        print(json.dumps(dict(impl=a.label, op=op, size=size, batch=k, clients=a.clients,
                              ops_s=objs / el, gb_s=objs * size / el / 1e9, p50_us=_pct(lat, .5),
                              p99_us=_pct(lat, .99), api=a.api,
                              working_set_mb=a.working_set_mb,
                              verified=all(m.get("verified", True) for m in ms))), flush=True)
    for p in procs:
        p.join(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
