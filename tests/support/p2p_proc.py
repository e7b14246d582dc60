"""A P2P node in its own process, driven by JSON lines on stdin (tests and benchmarks).

    python -m tests.support.p2p_proc --tracker URL [--host H] [--token T] [--chunk-size N]
        [--parallel N] [--strategy S] [--chunk-timeout S] [--protocol P]

Prints ``{"segment": NAME, "pid": PID}`` when ready, then answers one JSON line per command:

- ``{"op": "publish", "name": N, "size": BYTES, "seed": S, "version": V}``: publish seeded
  random bytes (two items); answers ``{"version", "sha"}``.
- ``{"op": "mutate", "seed": S}``: overwrite the last published buffers in place with other
  seeded bytes, telling nobody (a trainer's optimizer step); answers ``{"sha"}``.
- ``{"op": "get", "name": N, "version": V, "timeout": T}``: fetch; answers ``{"version", "sha",
  "sources", "failures", "seconds"}`` or ``{"error": ...}``.
- ``{"op": "corrupt", "chunks": [i, ...]}``: flip one byte of those chunks of the last get.
- ``{"op": "holdings"}``, ``{"op": "regions"}``, ``{"op": "withdraw", "name": N}``.

``sha`` is the sha256 of every item's bytes in order. Stops when stdin closes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from typing import Any

import numpy as np

from kvplane.common.errors import KVPlaneError
from kvplane.p2p import P2PConfig, P2PNode
from kvplane.p2p.node import GetResult


def payload(size: int, seed: int) -> dict[str, np.ndarray]:
    """Seeded random bytes as two items (a float32 matrix and a uint8 tail)."""
    rng = np.random.default_rng(seed)
    head = (size // 2) // 4 * 4
    return {"weight": rng.integers(0, 255, head, dtype=np.uint8).view(np.float32).reshape(-1, 1).copy(),
            "tail": rng.integers(0, 255, size - head, dtype=np.uint8)}


def sha_of(items: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for v in items.values():
        h.update(memoryview(np.ascontiguousarray(v)).cast("B"))
    return h.hexdigest()


class Driver:
    """Holds the node and what the commands act on."""

    def __init__(self, node: P2PNode) -> None:
        self.node = node
        self.published: dict[str, np.ndarray] = {}
        self.last: GetResult | None = None

    def publish(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.published = payload(int(cmd["size"]), int(cmd["seed"]))
        v = self.node.publish(cmd["name"], self.published, int(cmd.get("version", 0)))
        return {"version": v, "sha": sha_of(self.published)}

    def mutate(self, cmd: dict[str, Any]) -> dict[str, Any]:
        new = payload(sum(a.nbytes for a in self.published.values()), int(cmd["seed"]))
        for k, a in self.published.items():
            a[...] = new[k]
        return {"sha": sha_of(self.published)}

    def get(self, cmd: dict[str, Any]) -> dict[str, Any]:
        res = self.node.get(cmd["name"], int(cmd.get("version", 0)),
                            timeout=float(cmd.get("timeout", 60)), strategy=cmd.get("strategy"))
        self.last = res
        return {"version": res.manifest.version, "sha": sha_of(res.items),
                "sources": res.stats.sources, "failures": res.stats.failures,
                "seconds": res.stats.seconds, "size": res.manifest.total_size}

    def corrupt(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.last is not None, "corrupt needs a previous get"
        m = self.last.manifest
        for c in cmd["chunks"]:
            ch = m.chunks[c]
            arr = np.ascontiguousarray(self.last.items[m.items[ch.item].name]).view(np.uint8).reshape(-1)
            arr[ch.offset] ^= 0xFF
        return {"ok": True}

    def run(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd.get("op")
        if op in ("publish", "mutate", "get", "corrupt"):
            return getattr(self, op)(cmd)  # type: ignore[no-any-return]
        if op == "holdings":
            return {"holdings": self.node.holdings()}
        if op == "regions":
            return {"regions": len(self.node.engine.memory.regions())}
        if op == "withdraw":
            self.node.withdraw(cmd["name"])
            return {"ok": True}
        return {"error": f"unknown op {op!r}"}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tracker", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--token", default="")
    ap.add_argument("--chunk-size", type=int, default=1 << 20)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--strategy", default="rarest")
    ap.add_argument("--chunk-timeout", type=float, default=10.0)
    ap.add_argument("--protocol", default="auto")
    a = ap.parse_args(argv)
    node = P2PNode(P2PConfig(tracker=a.tracker, token=a.token, host=a.host, chunk_size=a.chunk_size,
                             parallel=a.parallel, strategy=a.strategy,
                             chunk_timeout=a.chunk_timeout, protocol=a.protocol))
    drv = Driver(node)
    print(json.dumps({"segment": node.name, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            out = drv.run(json.loads(line))
        except KVPlaneError as exc:
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)
    node.close()


if __name__ == "__main__":
    main()
