"""``benchmarks/store_scale.py pauses``: how long the master's lock is held, and how long other
RPCs wait, while a pass over many objects runs (an unmount's sweep, an eviction pass, repair
planning).

A :class:`~kvplane.store.master.server.MasterServer` runs in this process with its real timer;
``n`` objects go straight into its state (under its lock, before anything is measured). Its
lock is a :class:`HoldTimer`, which records how long each holder kept it: in the holder's
thread CPU time (what the master itself spent under the lock, unaffected by other processes
on a loaded machine) and in wall time. Meanwhile a probe in its own process sends ``exist``
RPCs back to back; its longest wait is the longest pause another client saw. Scenarios:

* ``unmount``: objects spread over two segments; the RPC unmount of an empty third segment,
  then of one holding half the objects (its sweep takes them out of their objects).
* ``evict``: the objects fill the pool past the high watermark; the timer's pass frees
  ``evict_ratio`` of it.
* ``repair``: objects with two replicas over three segments; unmounting one leaves two thirds
  of them short, and the timer plans their repairs (up to ``repair.SCAN`` a tick): the
  sweep and the planning are measured together.

Also reported: the CPU time of one full collection of Python's cyclic collector with the
objects in (before the probe starts; the collector runs one whenever enough objects survived,
in whichever thread is running, and every thread waits), and the longest collection during
the pass.

Imports the master server, the RPC client and the bench kit only.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from kvplane.common.rpc import RpcClient
from kvplane.store import inventory
from kvplane.store.master import repair
from kvplane.store.master.config import MasterConfig
from kvplane.store.master.server import MasterServer
from kvplane.store.master.state import MasterState
from kvplane.store.types import CodesRep, KeysReq, MountReq, ReplicateConfig, SegmentInfo

TOKEN = "store-scale-pauses-token"
VALUE = 1024
MiB = 1 << 20


class HoldTimer:
    """A lock that records how long each holder held it (thread CPU and wall seconds)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._t0 = (0.0, 0.0)
        self.longest_cpu = 0.0
        self.longest_wall = 0.0
        self.holds = 0

    def reset(self) -> None:
        """Forget the holds recorded so far."""
        self.longest_cpu = self.longest_wall = 0.0
        self.holds = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._lock.acquire(blocking, timeout)
        if got:
            self._t0 = (time.thread_time(), time.perf_counter())
        return got

    def release(self) -> None:
        cpu, wall = time.thread_time() - self._t0[0], time.perf_counter() - self._t0[1]
        self.holds += 1
        self.longest_cpu = max(self.longest_cpu, cpu)
        self.longest_wall = max(self.longest_wall, wall)
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


class GcTimer:
    """The longest collection of Python's cyclic collector (wall seconds) until ``close``."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._t0 = 0.0
        gc.callbacks.append(self._seen)

    def _seen(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.longest = max(self.longest, time.perf_counter() - self._t0)

    def close(self) -> None:
        gc.callbacks.remove(self._seen)


class Probe:
    """``exist`` RPCs back to back from another process; ``window()`` returns the longest
    wait since the last window."""

    def __init__(self, address: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvplane.bench.store_scale_pauses", "--probe", address],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._ask()  # its first call answered: it is running

    def _ask(self) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None  # PIPEs
        self.proc.stdin.write("window\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the probe exited")
        out: dict[str, Any] = json.loads(line)
        return out

    def window(self) -> dict[str, Any]:
        """{"calls", "longest_ms"} since the previous window."""
        return self._ask()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


def _probe_main(address: str) -> int:
    """The probe process: calls until stdin closes, answering each ``window`` line."""
    rpc = RpcClient(address, token=TOKEN, timeout=60.0)
    stats = {"calls": 0, "longest": 0.0}
    lock = threading.Lock()
    req = KeysReq("probe", ["probe-key"])
    first = threading.Event()

    def calls() -> None:
        while True:
            t0 = time.perf_counter()
            rpc.call("exist", req, CodesRep)
            took = time.perf_counter() - t0
            with lock:
                stats["calls"] += 1
                stats["longest"] = max(stats["longest"], took)
            first.set()

    threading.Thread(target=calls, daemon=True, name="probe").start()
    first.wait(60)
    for _line in sys.stdin:
        with lock:
            out = {"calls": stats["calls"], "longest_ms": round(stats["longest"] * 1000, 3)}
            stats["calls"], stats["longest"] = 0, 0.0
        print(json.dumps(out), flush=True)
    return 0


@dataclass
class Scenario:
    """One measured pass: its name, the objects, and what was seen."""

    name: str
    objects: int
    result: dict[str, Any] = field(default_factory=dict)


def _segment(name: str, size: int, client: str) -> SegmentInfo:
    return SegmentInfo(name, 1 << 44 | hash(name) % 1024 << 34, size, client, "127.0.0.1:9",
                       "scale-host")


def _key(prefix: str, i: int) -> str:
    return f"{prefix}{i:015d}"


def fill(st: MasterState, n: int, replica_num: int = 1, prefix: str = "k") -> None:
    """Put ``n`` objects of ``VALUE`` bytes straight into ``st`` (the caller holds its lock)."""
    cfg = ReplicateConfig(replica_num=replica_num)
    for i in range(n):
        key = _key(prefix, i)
        r = st.put_start(key, VALUE, cfg, 0.0, checksum=1)
        if r.code or st.put_end(key, 0.0, r.version, 1):
            raise RuntimeError(f"could not fill {key}: {r.code}")
        if len(st.changes) > 4096:
            st.changes.clear()
    st.changes.clear()


def _wait(what: Callable[[], bool], timeout: float, name: str) -> float:
    t0 = time.perf_counter()
    while not what():
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"{name} did not finish in {timeout}s")
        time.sleep(0.01)  # polling the server's state for the end of the pass
    return time.perf_counter() - t0


def run_scenario(name: str, n: int, timeout: float = 600.0) -> dict[str, Any]:
    """Set up scenario ``name`` with ``n`` objects, run its pass, return what was seen."""
    per = inventory.header_len(_key("k", 0)) + VALUE  # bytes of one object's allocation
    cfg = MasterConfig(client_ttl=1e9, lease_ttl=0.001, repair_timeout=1e9)
    with MasterServer(cfg, admin_port=None, token=TOKEN) as srv:
        timer = HoldTimer()
        srv.lock = timer  # type: ignore[assignment]  # a lock with the same interface
        st = srv.state
        with timer:
            if name == "evict":  # 93 % full; the watermark comes down once the probe runs
                st.config = dataclasses.replace(cfg, high_watermark=0.95)
                st.mount("c0", [_segment("s0", int(n * per / 0.93), "c0")], 0.0)
                fill(st, n)
            elif name == "unmount":
                st.mount("c0", [_segment("s0", 2 * n * per, "c0"),
                                _segment("s1", 2 * n * per, "c0"),
                                _segment("empty", 64 * MiB, "c0")], 0.0)
                fill(st, n)
            else:
                st.mount("c0", [_segment(f"s{i}", 2 * n * per, "c0") for i in range(3)], 0.0)
                fill(st, n, replica_num=2)
        t0 = time.thread_time()
        gc.collect()  # a full collection with the objects in: what the table costs it
        full_gc = time.thread_time() - t0
        probe = Probe(f"127.0.0.1:{srv.port}")
        # what this process held before (a test run's heap) is no master's: keep the cyclic
        # collector from walking it inside a hold
        gc.collect()
        gc.freeze()
        collections = GcTimer()
        try:
            out = _measure(name, n, srv, timer, probe, timeout)
        finally:
            collections.close()
            gc.unfreeze()
            probe.close()
        out["full_gc_cpu_ms"] = round(full_gc * 1000, 3)
        out["longest_gc_ms"] = round(collections.longest * 1000, 3)
        return out


def _measure(name: str, n: int, srv: MasterServer, timer: HoldTimer, probe: Probe,
             timeout: float) -> dict[str, Any]:
    st = srv.state
    out: dict[str, Any] = {"scenario": name, "objects": n}
    probe.window()
    timer.reset()
    rpc = RpcClient(f"127.0.0.1:{srv.port}", token=TOKEN, timeout=60.0)
    try:
        if name == "unmount":
            for seg in ("empty", "s1"):
                timer.reset()
                probe.window()
                rpc.call("unmount", MountReq("c0", [_segment(seg, 1, "c0")]), int)
                took = _wait(lambda: not st.sweeps, timeout, f"the sweep of {seg}")
                out[f"unmount_{seg}"] = _seen(timer, probe, took)
            out["objects_left"] = len(st.objects)
        elif name == "evict":
            with timer:
                st.config = dataclasses.replace(st.config, high_watermark=0.90)
                job = st.evict_start()  # the pass the timer will run (not run here)
                per = inventory.header_len(_key("k", 0)) + VALUE
                goal = -(-int(job.target) // per) if job is not None else 1
            took = _wait(lambda: st.evicted >= goal, timeout, "the eviction pass")
            out["evict"] = _seen(timer, probe, took)
            out["evicted"] = st.evicted
        else:  # the sweep of the unmounted segment, then repair planning of what it left short
            rpc.call("unmount", MountReq("c0", [_segment("s2", 1, "c0")]), int)
            took = _wait(lambda: not st.sweeps and len(st.repairs.pending) >= min(
                len(st.repairs.short), repair.SCAN), timeout, "the sweep and repair planning")
            out["unmount_repair"] = _seen(timer, probe, took)
            out["short"], out["planned"] = len(st.repairs.short), len(st.repairs.pending)
    finally:
        rpc.close()
    return out


def _seen(timer: HoldTimer, probe: Probe, took: float) -> dict[str, float]:
    seen = probe.window()
    return {"pass_s": round(took, 3), "longest_hold_cpu_ms": round(timer.longest_cpu * 1000, 3),
            "longest_hold_wall_ms": round(timer.longest_wall * 1000, 3),
            "longest_rpc_ms": seen["longest_ms"], "probe_calls": seen["calls"]}


def main(argv: list[str] | None = None) -> int:
    """Command line of ``benchmarks/store_scale.py pauses``."""
    ap = argparse.ArgumentParser(prog="store_scale.py pauses",
                                 description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--objects", default="1000000", help="objects, comma-separated counts")
    ap.add_argument("--scenarios", default="unmount,evict,repair")
    ap.add_argument("--probe", help=argparse.SUPPRESS)  # internal: run as the probe process
    a = ap.parse_args(argv)
    if a.probe:
        return _probe_main(a.probe)
    from kvplane.bench.store_scale_memory import cpu_times, host_load

    for n in (int(x) for x in a.objects.split(",")):
        for name in a.scenarios.split(","):
            before = cpu_times()
            row = run_scenario(name, n)
            row.update(host_load(before))
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
