"""A store client process for tests: reads JSON commands on stdin, answers JSON on stdout.

Values are derived from their keys (``value_of``), so any process can verify any object.

    python -m tests.support.store_client_proc --master HOST:PORT|etcd://H:P/CLUSTER
        [--protocol tcp] [--host IP] [--segment-mb 0]
        [--timeout 5] [--checksum | --no-checksum]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import zlib

import numpy as np

from kvplane.common.errors import KVPlaneError
from kvplane.store.client.client import StoreClient
from kvplane.store.config import StoreConfig
from kvplane.store.types import ReplicateConfig


def round_value(key: str, round_: int, size: int) -> np.ndarray:
    """Random bytes, distinct per key and per write round (a stale read shows as wrong bytes)."""
    seed = (hash(key) & 0xFFFF_FFFF) ^ (round_ * 7919)
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def value_of(key: str, size: int) -> np.ndarray:
    """The bytes stored under ``key`` in these tests."""
    seed = zlib.crc32(key.encode())
    return ((np.arange(size, dtype=np.int64) * 7 + seed) % 251).astype(np.uint8)


def check(c: StoreClient, key: str, size: int) -> str:
    """"ok", "missing" or "corrupt"."""
    try:
        got = c.get(key)
    except KVPlaneError:
        return "missing"
    return "ok" if np.array_equal(np.frombuffer(got, np.uint8), value_of(key, size)) else "corrupt"


def mixed(c: StoreClient, n: int, prefix: str, seed: int) -> dict[str, object]:
    """``n`` random puts / gets / removes; returns what was acknowledged and what went wrong."""
    rng = random.Random(seed)
    live: dict[str, int] = {}
    stats = {"put": 0, "get": 0, "remove": 0, "corrupt": 0, "lost": 0, "errors": 0}
    for i in range(n):
        r = rng.random()
        if r < 0.5 or not live:
            key, size = f"{prefix}-{i}", rng.choice([64, 4096, 20000, 65536])
            try:
                c.put(key, value_of(key, size).tobytes())
            except KVPlaneError:
                stats["errors"] += 1
            else:
                live[key] = size
                stats["put"] += 1
        elif r < 0.9:
            key = rng.choice(list(live))
            res = check(c, key, live[key])
            stats["get"] += 1
            if res == "corrupt":
                stats["corrupt"] += 1
            elif res == "missing":
                stats["lost"] += 1
        else:
            key = rng.choice(list(live))
            if c.batch_remove([key], force=True)[0] is None:
                del live[key]
                stats["remove"] += 1
    return {"live": live, **stats}


def read_loop(c: StoreClient, keys: dict[str, int], seconds: float) -> dict[str, object]:
    """Read and verify ``keys`` round-robin for ``seconds``; report outcomes and worst latency."""
    out = {"ok": 0, "missing": 0, "corrupt": 0, "max_latency_s": 0.0}
    end = time.monotonic() + seconds
    items = list(keys.items())
    i = 0
    while time.monotonic() < end:
        key, size = items[i % len(items)]
        t = time.monotonic()
        res = check(c, key, size)
        out["max_latency_s"] = max(out["max_latency_s"], time.monotonic() - t)  # type: ignore[type-var]
        out[res] += 1  # type: ignore[operator]
        i += 1
    return out


def churn(c: StoreClient, seconds: float, prefix: str, seed: int, replicas: int,
          keep: int = 300) -> dict[str, object]:
    """Puts (``replicas`` each) and verified gets for ``seconds``, keeping at most ``keep`` live
    keys (older ones are removed). Reports what was acknowledged, what went wrong, and the
    slowest single call."""
    rng = random.Random(seed)
    cfg = ReplicateConfig(replica_num=replicas)
    live: dict[str, int] = {}
    out = {"put": 0, "put_failed": 0, "get": 0, "get_failed": 0, "corrupt": 0, "max_call_s": 0.0}

    def timed(fn):  # type: ignore[no-untyped-def]
        t = time.monotonic()
        try:
            return fn()
        finally:
            out["max_call_s"] = max(out["max_call_s"], time.monotonic() - t)  # type: ignore[type-var]

    end, i = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        i += 1
        if rng.random() < 0.5 or not live:
            key, size = f"{prefix}-{i}", rng.choice([4096, 20000, 65536, 262144])
            value = value_of(key, size).tobytes()
            try:
                timed(lambda: c.put(key, value, cfg))  # noqa: B023  (called in this iteration)
                live[key] = size
                out["put"] += 1  # type: ignore[operator]
            except KVPlaneError:
                out["put_failed"] += 1  # type: ignore[operator]
            if len(live) > keep:
                old = next(iter(live))
                if timed(lambda: c.batch_remove([old], force=True))[0] is None:  # noqa: B023  (called now)
                    del live[old]
        else:
            key = rng.choice(list(live))
            res = timed(lambda: check(c, key, live[key]))  # noqa: B023  (called in this iteration)
            out["get"] += 1  # type: ignore[operator]
            if res == "corrupt":  # wrong bytes returned as a success
                out["corrupt"] += 1  # type: ignore[operator]
            elif res == "missing":
                out["get_failed"] += 1  # type: ignore[operator]
    return {"live": live, "corrupt_reads": c.corrupt_reads, **out}


def health(c: StoreClient) -> str:
    """"ok", or the class name of the error the master ping raised."""
    try:
        c.health_check()
    except KVPlaneError as exc:
        return type(exc).__name__
    return "ok"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--master", required=True)
    ap.add_argument("--protocol", default="auto")
    ap.add_argument("--host", default="127.0.0.1", help="address this client's engine binds")
    ap.add_argument("--segment-mb", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--checksum", action=argparse.BooleanOptionalAction, default=False,
                    help="store checksums (off by default, as in StoreConfig)")
    a = ap.parse_args(argv)
    c = StoreClient(StoreConfig(master=a.master, protocol=a.protocol, timeout=a.timeout,
                                local_hostname=a.host,
                                global_segment_size=a.segment_mb << 20, local_buffer_size=16 << 20,
                                checksum=a.checksum))
    print(json.dumps({"segment": c.segment_name}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "put":
            cfg = ReplicateConfig(replica_num=cmd.get("replicas", 1),
                                  preferred_segment=cmd.get("preferred", ""))
            keys, size = cmd["keys"], cmd["size"]
            results = c.put_batch(keys, [value_of(k, size).tobytes() for k in keys], cfg)
            res: object = [0 if r is None else r.code for r in results]
        elif op == "check":
            res = {k: check(c, k, s) for k, s in cmd["keys"].items()}
        elif op == "mixed":
            res = mixed(c, cmd["n"], cmd["prefix"], cmd["seed"])
        elif op == "churn":
            res = churn(c, cmd["seconds"], cmd["prefix"], cmd["seed"], cmd.get("replicas", 2),
                        cmd.get("keep", 300))
        elif op == "remove":
            res = [0 if r is None else r.code
                   for r in c.batch_remove(cmd["keys"], force=cmd.get("force", True))]
        elif op == "read_loop":
            res = read_loop(c, cmd["keys"], cmd["seconds"])
        elif op == "health":
            res = health(c)
        elif op == "slices":  # slices handed to each transport so far (which one moved bytes)
            from kvplane.common import metrics
            res = {smp.labels["transport"]: smp.value
                   for m in metrics.TRANSFER_SLICES.collect() for smp in m.samples
                   if smp.name.endswith("_total")}
        elif op == "fabric":
            res = c.engine.fabric.as_dict()
        else:
            res = {"error": f"unknown op {op}"}
        print(json.dumps({"result": res, "remounts": c.remounts}), flush=True)
    c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
