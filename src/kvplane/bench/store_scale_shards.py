"""Sharded metadata throughput (issue 32): aggregate ``exists`` and lookup ops/s of one master
against N master shards (each its own process), with clients in their own processes.

Each repeat runs the pools interleaved (one master, then N shards, ...), each with one segment
process holding ``--keys`` objects. In a pool, ``--clients`` worker processes each loop on one
operation for ``--seconds``, all started at once:

* ``exists``: ``batch_exists`` of ``--batch`` keys (``--batch 1``: ``exists`` of one key);
* ``lookup``: the master's part of a get (``get_replicas`` of ``--batch`` keys, columns asked
  for as a get asks), without the data read, which the segments serve, not the masters.

``--grouped`` makes each batch hold keys of one shard (as keys sharing a hash tag do), else
batches are random keys, split by the client among the shards. Keys (and their owners) are
what a client of the pool would send. Reported per pool and op: ops/s (keys answered per
second, summed over the clients), the masters' and the clients' CPU seconds per operation
(``/proc/PID/stat`` of each master, ``time.process_time`` in each client), and the median over
repeats; the ratio of N shards to one master; the load average and the host's CPU steal over
the run (``/proc/stat``). ``python -m kvplane.bench.store_scale_shards worker ...`` is the
client process.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from kvplane.bench.services import CLI
from kvplane.common.procs import Proc, free_port

TICK = os.sysconf("SC_CLK_TCK")
# the clients and the segment move no bytes here: NIXL stays unloaded (an idle NIXL agent's
# progress thread spun a core before main's 7b909eb; that is not what this measures)
QUIET = {"KVPLANE_NIXL": "off"}


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) a process used so far."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def host_cpu() -> tuple[int, int]:
    """(all jiffies, steal jiffies) of the host so far (``/proc/stat``)."""
    with open("/proc/stat", encoding="ascii") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    return sum(vals), vals[7] if len(vals) > 7 else 0


@contextmanager
def pool(shards: int, spin: str | None = None) -> Iterator[tuple[str, list[int]]]:
    """One master (``shards`` 0) or ``shards`` shard processes, and one segment; yields (an
    address, the masters' pids). ``spin``: the masters' ``KVPLANE_MASTER_SPIN``."""
    env = {} if spin is None else {"KVPLANE_MASTER_SPIN": spin}
    with ExitStack() as stack:
        if shards == 0:
            m = stack.enter_context(Proc([*CLI, "master", "--port", "0", "--admin-port", "0"],
                                         env=env, stop_signal=signal.SIGTERM))
            masters = [m]
        else:
            ports = [free_port() for _ in range(shards)]
            peers = ",".join(f"127.0.0.1:{p}" for p in ports)
            masters = [stack.enter_context(Proc(
                [*CLI, "master", "--shard", f"{i}/{shards}", "--peers", peers, "--port",
                 str(ports[i]), "--admin-port", "0"], env=env, stop_signal=signal.SIGTERM))
                for i in range(shards)]
        addr = masters[0].info["master"]
        stack.enter_context(Proc([*CLI, "segment", "--master", addr, "--size", "256MiB"],
                                 env=QUIET, stop_signal=signal.SIGTERM))
        yield addr, [m.pid for m in masters]


def load_keys(addr: str, keys: int) -> None:
    """Put ``keys`` small objects (``sk-I``) into the pool."""
    from kvplane.store.client.client import StoreClient

    with StoreClient(master=addr, protocol="tcp") as c:
        for i in range(0, keys, 512):
            names = [f"sk-{j}" for j in range(i, min(keys, i + 512))]
            got = c.put_batch(names, [b"v" * 64] * len(names))
            if any(e is not None for e in got):
                raise RuntimeError(f"loading keys failed: {next(e for e in got if e)}")


def run_clients(addr: str, a: argparse.Namespace, op: str, pids: list[int]) -> dict[str, Any]:
    """``a.clients`` worker processes doing ``op`` at once; their sums and the masters' CPU."""
    args = ["--master", addr, "--op", op, "--batch", str(a.batch), "--keys", str(a.keys),
            "--seconds", str(a.seconds)] + (["--grouped"] if a.grouped else [])
    with ExitStack() as stack:
        workers = [stack.enter_context(Proc([sys.executable, "-m", __name__, "worker", *args,
                                             "--seed", str(i)], env=QUIET))
                   for i in range(a.clients)]
        cpu0 = [proc_cpu(p) for p in pids]
        host0 = host_cpu()
        for w in workers:
            stdin = w.popen.stdin
            assert stdin is not None  # (Proc opens a PIPE)
            stdin.write("go\n")
            stdin.flush()
        got = [w.ask("", a.seconds + 60) for w in workers]  # (empty line: read the result)
        cpu = sum(proc_cpu(p) for p in pids) - sum(cpu0)
        host1 = host_cpu()
    ops = sum(g["ops"] for g in got)
    span = max(g["seconds"] for g in got)
    return {"ops_per_s": ops / span, "ops": ops, "seconds": round(span, 3),
            "master_cpu_us_per_op": 1e6 * cpu / max(ops, 1),
            "client_cpu_us_per_op": 1e6 * sum(g["cpu_s"] for g in got) / max(ops, 1),
            "master_cores": cpu / span, "errors": sum(g["errors"] for g in got),
            "steal_percent": 100 * (host1[1] - host0[1]) / max(1, host1[0] - host0[0])}


def worker(argv: list[str]) -> int:
    """A client process: builds its batches, waits for ``go``, loops ``--seconds``, prints."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--master", required=True)
    ap.add_argument("--op", choices=["exists", "lookup"], required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--keys", type=int, default=20000)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--grouped", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    from kvplane.store.client.client import StoreClient
    from kvplane.store.types import KeysReq, ResultsRep

    rng = random.Random(a.seed)
    c = StoreClient(master=a.master, protocol="tcp", location_cache=0)
    names = [f"sk-{i}" for i in range(a.keys)]
    shard_of = getattr(c.rpc, "shard_of", lambda _k: 0)
    groups: dict[int, list[str]] = {}
    for k in names:
        groups.setdefault(shard_of(k) if a.grouped else 0, []).append(k)
    pools = list(groups.values())
    batches = [rng.sample(pools[i % len(pools)], a.batch) for i in range(256)]
    cid = c.config.client_id
    if a.op == "exists":
        def one(keys: list[str]) -> bool:
            return c.exists(keys[0]) if len(keys) == 1 else all(c.batch_exists(keys))
    else:
        def one(keys: list[str]) -> bool:
            rep = c.rpc.call("get_replicas", KeysReq(cid, keys, columns=True), ResultsRep)
            return rep.columns is not None or all(r.code == 0 for r in rep.results)
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()  # go
    ops = errors = 0
    t0, c0 = time.monotonic(), time.process_time()
    end, i = t0 + a.seconds, 0
    while time.monotonic() < end:
        keys = batches[i & 255]
        i += 1
        if one(keys):
            ops += len(keys)
        else:
            errors += 1
    out = {"ops": ops, "errors": errors, "seconds": time.monotonic() - t0,
           "cpu_s": time.process_time() - c0}
    sys.stdin.readline()
    print(json.dumps(out), flush=True)
    c.close()
    return 0


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("ops_per_s", "master_cpu_us_per_op", "client_cpu_us_per_op", "master_cores",
            "steal_percent")
    return {k: round(statistics.median(r[k] for r in rows), 2) for k in keys} | {
        "repeats": len(rows), "errors": sum(r["errors"] for r in rows)}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (see the module docstring); prints one JSON document."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["worker"]:
        return worker(args[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=2, help="shards of the sharded pool")
    ap.add_argument("--clients", type=int, default=4, help="client processes")
    ap.add_argument("--keys", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=64, help="keys per call (1: single-key calls)")
    ap.add_argument("--seconds", type=float, default=3.0, help="of load per cell")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ops", default="exists,lookup")
    ap.add_argument("--grouped", action="store_true",
                    help="each batch holds keys of one shard (as keys sharing a hash tag)")
    ap.add_argument("--master-spin", default=None,
                    help="the masters' KVPLANE_MASTER_SPIN (seconds; default: theirs)")
    a = ap.parse_args(args)
    os.environ.update(QUIET)  # (this process loads the keys)
    ops = a.ops.split(",")
    load0 = os.getloadavg()[0]
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for _ in range(a.repeats):
        for shards in (0, a.shards):  # interleaved: one master, then the shards
            with pool(shards, a.master_spin) as (addr, pids):
                load_keys(addr, a.keys)
                for op in ops:
                    name = "one master" if shards == 0 else f"{shards} shards"
                    rows.setdefault((name, op), []).append(run_clients(addr, a, op, pids))
    out: dict[str, Any] = {"config": vars(a), "load_before": load0,
                           "load_after": os.getloadavg()[0], "cells": {}}
    for (name, op), got in rows.items():
        out["cells"][f"{name} {op}"] = median_row(got)
    for op in ops:
        one = out["cells"][f"one master {op}"]["ops_per_s"]
        many = out["cells"][f"{a.shards} shards {op}"]["ops_per_s"]
        out[f"ratio {op}"] = round(many / one, 3) if one else None
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
