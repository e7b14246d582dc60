"""What a tenant's client pays for data-plane isolation (issue 28): service vs tenant, one run.

Starts a master (``--tenants``) and one segment process on 127.0.0.1, then three StoreClients
in this process, measured in turns (``--repeat`` rounds, each side ``--ops`` puts then as many
gets (cold, then hot) of ``--size``-byte values per round, median of the rounds' per-op times):

* ``service-auto``: the service token, shared memory on this host (what a tenant had before);
* ``service-tcp``: the service token over TCP (no grants: the pool's own connections);
* ``tenant``: a tenant's token: TCP only, and every lookup and PutStart installs its grants at
  the segment (one GRANT frame) before the data moves; held reads install nothing.

Every get is checked against the value put (a wrong byte fails the run). Usage:

    python benchmarks/store_tenant.py [--size 4096] [--ops 2000] [--repeat 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

SVC = "service-token-bench-0123456789"
TENANT = "tenant-a-token-bench-0123456789"
OPS = ("put", "get", "get-hot")


def _round(client, who: str, rnd: int, ops: int, size: int) -> tuple[float, float, float]:
    """Per-op microseconds of ``ops`` puts, ``ops`` gets of what was put (cold: the first get
    of each key), and the same gets again (hot: keys this client just read)."""
    value = os.urandom(size)
    keys = [f"{who}-{rnd}-{i}" for i in range(ops)]
    t = time.perf_counter()
    for k in keys:
        client.put(k, value)
    put = (time.perf_counter() - t) / ops * 1e6
    t = time.perf_counter()
    for k in keys:
        if client.get(k) != value:
            raise RuntimeError(f"{who}: wrong bytes under {k}")
    get = (time.perf_counter() - t) / ops * 1e6
    t = time.perf_counter()
    for k in keys:
        if client.get(k) != value:
            raise RuntimeError(f"{who}: wrong bytes under {k}")
    hot = (time.perf_counter() - t) / ops * 1e6
    client.batch_remove(keys)
    return put, get, hot


def main(argv: list[str] | None = None) -> int:
    """Run the three sides interleaved; print a table or JSON rows."""
    from kvplane.store import StoreClient
    from tests.support.store_procs import spawn_master, spawn_segment

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tenants.json")
        with open(path, "w") as f:
            json.dump({"tenants": {"teamA": TENANT}}, f)
        os.chmod(path, 0o600)
        with spawn_master("--token", SVC, "--tenants", path) as m, \
                spawn_segment(m.info["master"], "256MiB", "--token", SVC, "--tenants", path):
            addr = m.info["master"]
            sides = {"service-auto": StoreClient(master=addr, token=SVC, timeout=10),
                     "service-tcp": StoreClient(master=addr, token=SVC, protocol="tcp", timeout=10),
                     "tenant": StoreClient(master=addr, token=TENANT, timeout=10)}
            times: dict[str, list[tuple[float, float, float]]] = {w: [] for w in sides}
            try:
                for rnd in range(a.repeat):
                    for who, c in sides.items():
                        times[who].append(_round(c, who, rnd, a.ops, a.size))
            finally:
                for c in sides.values():
                    c.close()
    base = {op: statistics.median(t[i] for t in times["service-auto"])
            for i, op in enumerate(OPS)}
    for who, t in times.items():
        for i, op in enumerate(OPS):
            p50 = statistics.median(x[i] for x in t)
            row = {"side": who, "op": op, "size": a.size, "ops": a.ops, "repeat": a.repeat,
                   "p50_us": round(p50, 1), "vs_service_auto": round(p50 / base[op], 2),
                   "protocol": sides[who].engine.config.protocol}
            print(json.dumps(row) if a.json else
                  f"{who:13s} {op}  {a.size:>7d} B  {p50:8.1f} us/op  "
                  f"x{row['vs_service_auto']:.2f} of service-auto  ({row['protocol']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
