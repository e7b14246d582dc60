"""``benchmarks/store_scale.py cpu|cold|bytes``: the master's RPC cost, cold reads, puts and
bytes-returning gets, side by side with real Mooncake in one run (issue 32).

Every measurement starts the side's master and one segment process (``kvplane master`` +
``kvplane segment``; ``mooncake_master`` + ``mooncake_client``), then client processes
(``store_scale_loop``) that set up and preload off the clock and start their measured phase on
one signal. Sides alternate within each of ``--repeat`` rounds; a cell's figure is the median
of its rounds. Each row carries the host's load average and CPU steal over its window.

* ``cpu``: master CPU time (all its threads, from ``/proc/<pid>/task/*/schedstat``) per 100k
  operations, per op: ``exists``, ``get`` (``get_into``; kvplane with held reads off, so every
  get asks the master), ``put``, ``bget32``, ``bput32``. Clients are paced to the same call
  rate on both sides (``--rate`` per client), so both masters see the same load.
* ``cold``: single 4 KiB ``get_into`` of keys this client never read (another process put
  them), the same preceded by an ``is_exist`` of the key (``coldx``, both timed), and single
  puts: per-call latency, with 1 or more segment processes (``--segments 1,64``). Both
  stores' sides run over TCP; side ``kvplane-shm`` (default in ``cold``) is kvplane with its
  default protocol (``auto``), which copies a same-host segment's shared memory directly
  (Mooncake 0.3.13's store offers tcp, rdma and device protocols, none of them that).
  Sides ``raw`` and ``raw-c`` (default in ``cold``) are the floor: the same cells as two bare
  TCP round trips between Python processes, and between C processes
  (:mod:`kvplane.bench.raw_rtt`).
* ``bytes``: ``get(key)`` returning bytes of ``--size`` values cycling over ``--working-set``
  bytes of keys (larger than the CPU caches by default), each value checked.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvplane.bench.store import Services, start_kvplane, start_mooncake
from kvplane.bench.transfer import find_mooncake_python

LOOP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "store_scale_loop.py")
SIDES = ("kvplane", "mooncake")
FLOORS = ("raw", "raw-c")  # ``cold`` only: bare round trips in Python and in C (raw_rtt)


@dataclass
class Options:
    """What to measure; sizes in bytes, durations in seconds."""

    ops: list[str] = field(default_factory=lambda: ["exists", "get", "put", "bget32", "bput32"])
    sides: list[str] = field(default_factory=lambda: list(SIDES))
    clients: int = 2
    rate: float = 0.0  # calls/s per client (0: unpaced)
    duration: float = 2.0
    repeat: int = 5
    size: int = 4096
    keys: int = 1024
    working_set: int = 512 << 20  # bytes: ``bytes`` cycles over this much
    segment_mb: int = 2048
    segments: list[int] = field(default_factory=lambda: [1])  # ``cold``: segment processes
    extra_segment_mb: int = 64  # each segment process past the first
    mooncake_python: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # extra env for kvplane's processes
    before: str = ""  # the src/ of another kvplane tree: side "before" runs it (an A/B)


def host_sample() -> tuple[float, int, int]:
    """(1-minute load average, steal ticks, all ticks) of the host now (``/proc``)."""
    with open("/proc/loadavg", encoding="ascii") as f:
        load = float(f.read().split()[0])
    with open("/proc/stat", encoding="ascii") as f:
        cpu = [int(x) for x in f.readline().split()[1:]]
    return load, cpu[7] if len(cpu) > 7 else 0, sum(cpu)


def steal_pct(before: tuple[float, int, int], after: tuple[float, int, int]) -> float:
    """Host CPU steal between two :func:`host_sample` s, percent of all ticks."""
    ticks = after[2] - before[2]
    return 100.0 * (after[1] - before[1]) / ticks if ticks > 0 else 0.0


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of ``pid`` so far (schedstat: ns, all threads, live ones)."""
    total = 0
    base = f"/proc/{pid}/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/schedstat", encoding="ascii") as f:
                total += int(f.read().split()[0])
        except OSError:
            continue  # a thread that ended meanwhile
    return total / 1e9


def process_cpu(pid: int) -> float:
    """CPU time of ``pid`` (utime + stime, ended threads included), seconds."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


class Clients:
    """``n`` load workers of one side, started and preloaded; :meth:`go` runs their phase."""

    def __init__(self, side: Side, op: str, n: int, opt: Options,
                 prefix: str | None = None) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        full = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1", GLOG_minloglevel="2",
                    **side.env)
        impl = side.impl
        try:
            for i in range(n):
                cmd = [side.py, LOOP, "--impl", impl, "--master", side.master, "--metadata",
                       side.metadata, "--protocol", side.protocol,
                       "--op", op, "--size", str(opt.size), "--keys", str(opt.keys),
                       "--duration", str(opt.duration), "--rate", str(opt.rate),
                       "--prefix", prefix or f"{impl}-{op}-{i}-{os.getpid()}",
                       "--seed", "0" if prefix else str(i),
                       "--local-buffer-mb", str(max(64, 4 * opt.size >> 20))]
                self.procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE,
                                                   stdout=subprocess.PIPE, text=True, env=full))
            for p in self.procs:
                self._read(p, 600)
        except BaseException:
            self.close()
            raise

    def _read(self, p: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
        from kvplane.common.procs import wait_for_line

        assert p.stdout is not None
        try:
            return dict(json.loads(wait_for_line(p.stdout, timeout)))
        except (EOFError, ValueError) as exc:
            raise RuntimeError(f"load worker {p.args!r} failed (rc {p.poll()})") from exc

    def go(self, timeout: float) -> list[dict[str, Any]]:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        out = [self._read(p, timeout) for p in self.procs]
        bad = [o.get("error") for o in out if not o.get("ok")]
        if bad:
            raise RuntimeError(f"load worker failed: {bad[0]}")
        return out

    def close(self) -> None:
        for p in self.procs:
            try:
                if p.stdin is not None and p.poll() is None:
                    p.stdin.write("quit\n")
                    p.stdin.close()
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.procs.clear()


@dataclass
class Side:
    """A started side: its master's pid and address, and the interpreter its clients use."""

    name: str
    py: str
    impl: str
    master: str
    metadata: str
    master_pid: int
    env: dict[str, str]
    protocol: str = "tcp"  # the transfer protocol its segments and clients set up with


def start_side(svc: Services, name: str, opt: Options, mc_python: str | None,
               segments: int = 1, held: bool = False) -> Side:
    """Start ``name``'s master and ``segments`` segment processes in ``svc`` (the first of
    ``opt.segment_mb``, the others of ``opt.extra_segment_mb`` each). kvplane's clients run
    with checksums off (as Mooncake's) and held reads only if ``held``."""
    if name == "mooncake":
        assert mc_python is not None
        master, url = start_mooncake(svc, mc_python, True, opt.segment_mb)
        pkg = subprocess.run([mc_python, "-c", "import mooncake,os;print(os.path.dirname("
                              "mooncake.__file__))"], capture_output=True, text=True,
                             check=True).stdout.strip()
        for _ in range(segments - 1):
            _mooncake_segment(svc, pkg, master, url, opt.extra_segment_mb)
        return Side(name, mc_python, "mooncake", master, url, svc.procs[0].pid, {})
    env = {"KVPLANE_STORE_HELD_READS": "1" if held else "0", "KVPLANE_STORE_CHECKSUM": "0",
           **opt.env}
    if name == "before":  # another kvplane tree (``--before``): its master, segments, clients
        env["PYTHONPATH"] = os.pathsep.join([opt.before, os.getcwd()])
    # kvplane-shm: the same-host protocol kvplane picks by default (auto: a segment's shared
    # memory copied directly, no segment process woken); the others TCP, as Mooncake's
    protocol = "auto" if name == "kvplane-shm" else "tcp"
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the master and segment processes inherit it
    try:
        master = start_kvplane(svc, True, opt.segment_mb, protocol=protocol)
        for _ in range(segments - 1):
            _kvplane_segment(svc, master, opt.extra_segment_mb, protocol)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return Side(name, sys.executable, "kvplane", master, "P2PHANDSHAKE", svc.procs[0].pid, env,
                protocol)


def _kvplane_segment(svc: Services, master: str, mb: int, protocol: str = "tcp") -> None:
    """One more ``kvplane segment`` process of ``mb`` MiB, ready when it returns."""
    from kvplane.common.procs import wait_until

    ready = os.path.join(svc.tmp, f"seg{len(svc.procs)}.json")
    p = subprocess.Popen([sys.executable, "-m", "kvplane.cli.main", "segment", "--master", master,
                          "--size", f"{mb}MiB", "--ready-file", ready, "--protocol", protocol],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         stdin=subprocess.DEVNULL)
    svc.procs.append(p)
    wait_until(lambda: os.path.exists(ready) or p.poll() is not None, 60, "a kvplane segment")
    if p.poll() is not None:
        raise RuntimeError("kvplane segment failed to start")


def _mooncake_segment(svc: Services, pkg: str, master: str, url: str, mb: int) -> None:
    """One more ``mooncake_client`` (in ``pkg``, the mooncake package's directory)
    contributing ``mb`` MB, its port open when it returns."""
    from kvplane.common.procs import free_port

    port = free_port()
    svc.start([f"{pkg}/mooncake_client", "--host=127.0.0.1", f"--port={port}",
               f"--global_segment_size={mb} MB", "--local_buffer_size=0", "--protocol=tcp",
               f"--master_server_address={master}", f"--metadata_server={url}"], port,
              {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "GLOG_minloglevel": "2"})


def measure_cpu(side: Side, op: str, opt: Options) -> dict[str, Any]:
    """One ``cpu`` cell: the master's CPU time over the clients' measured phase."""
    clients = Clients(side, op, opt.clients, opt)
    try:
        host0 = host_sample()
        cpu0 = cpu_seconds(side.master_pid)
        t0 = time.perf_counter()
        got = clients.go(opt.duration * 4 + 60)
        wall = time.perf_counter() - t0
        cpu = cpu_seconds(side.master_pid) - cpu0
        host1 = host_sample()
    finally:
        clients.close()
    ops = sum(g["ops"] for g in got)
    calls = sum(g["calls"] for g in got)
    lat = sorted(x for g in got for x in g["lat"])
    return {"side": side.name, "op": op, "ops": ops, "calls": calls,
            "ops_s": ops / max(g["elapsed"] for g in got),
            "master_cpu_s": cpu, "master_cpu_pct": 100 * cpu / wall,
            "cpu_per_100k_s": cpu / ops * 1e5 if ops else float("nan"),
            "p50_us": lat[len(lat) // 2] / 1e3 if lat else float("nan"),
            "load": host1[0], "steal_pct": steal_pct(host0, host1)}


def median_rows(rows: list[dict], key: tuple[str, ...], field_: str) -> list[dict]:
    """Per cell (``key``) the row with the median ``field_`` (lower middle), with the cell's
    spread (``min``, ``max``) and ``runs``."""
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault(tuple(r[k] for k in key), []).append(r)
    out = []
    for group in cells.values():
        group.sort(key=lambda r: r[field_])
        mid = dict(group[(len(group) - 1) // 2])
        mid.update(runs=len(group), min=group[0][field_], max=group[-1][field_],
                   median=statistics.median(r[field_] for r in group))
        out.append(mid)
    return out


def ratios(kind: str, rows: list[dict]) -> list[dict]:
    """kvplane against Mooncake per cell, from the medians: ``cpu``, master CPU per op
    kvplane / Mooncake (target <= 2); ``cold``, p50 latency Mooncake / kvplane (target >= 1.5);
    ``bytes``, GB/s kvplane / Mooncake (target >= 1.5 for ``getb``). With side ``raw`` or
    ``raw-c`` in a ``cold`` run, each other side's share of that floor too (``vs="raw"``: raw
    p50 / its p50, 1.0 at the floor)."""
    key, _ = FIGURES[kind]
    by = {tuple(r[k] for k in key): r for r in rows}
    out = []
    for cell, r in by.items():
        for floor in FLOORS:
            raw = by.get((floor, *cell[1:]))
            if kind == "cold" and raw and r["side"] not in FLOORS and r["median"]:
                out.append(dict(zip(key[1:], cell[1:]), side=r["side"], vs=floor,
                                raw=raw["median"], p50=r["median"],
                                ratio=raw["median"] / r["median"], target=""))
        mc = by.get(("mooncake", *cell[1:]))
        if r["side"] in ("mooncake", *FLOORS) or mc is None or not mc["median"] or not r["median"]:
            continue
        row = dict(zip(key[1:], cell[1:]), side=r["side"], vs="mooncake", kvplane=r["median"],
                   mooncake=mc["median"])
        if kind == "cpu":
            row.update(kvplane_us_per_op=r["median"] * 10, mooncake_us_per_op=mc["median"] * 10,
                       ratio=r["median"] / mc["median"], target="<= 2.0")
        elif kind == "cold":
            row.update(ratio=mc["median"] / r["median"], target=">= 1.5")
        else:
            row.update(ratio=r["median"] / mc["median"],
                       target=">= 1.5" if r["op"] == "getb" else "")
        out.append(row)
    return out


def _phase(side: Side, op: str, opt: Options, prefix: str | None = None) -> dict[str, Any]:
    """One client process running ``op`` once: its per-call latencies and rate."""
    clients = Clients(side, op, 1, opt, prefix)
    try:
        host0 = host_sample()
        got = clients.go(opt.duration * 4 + 120)[0]
        host1 = host_sample()
    finally:
        clients.close()
    lat = sorted(got["lat"])
    return {"side": side.name, "op": op, "calls": got["calls"], "ops": got["ops"],
            "shm_mapped": got.get("shm_mapped", 0),
            "ops_s": got["ops"] / got["elapsed"] if got["elapsed"] else float("nan"),
            "p50_us": lat[len(lat) // 2] / 1e3 if lat else float("nan"),
            "mean_us": sum(lat) / len(lat) / 1e3 if lat else float("nan"),
            "load": host1[0], "steal_pct": steal_pct(host0, host1)}


def measure_cold(side: Side, opt: Options, segments: int) -> list[dict[str, Any]]:
    """Cold single gets (keys another process put, each read once by a client that never
    read them: ``cold``; the same after an ``is_exist`` of the key, timed together:
    ``coldx``) and single puts."""
    prefix = f"cold-{side.name}-{os.getpid()}-{time.monotonic_ns()}"
    fill = Clients(side, "fill", 1, opt, prefix)
    try:
        fill.go(600)
        rows = [_phase(side, op, opt, prefix) for op in ("cold", "coldx")]  # fresh readers
    finally:
        fill.close()
    rows.append(_phase(side, "put", opt))
    return [dict(r, segments=segments, size=opt.size) for r in rows]


def measure_raw(opt: Options, segments: int, side: str) -> list[dict[str, Any]]:
    """Side ``raw`` (Python) or ``raw-c`` of ``cold``: the same cells as bare round trips
    (:mod:`kvplane.bench.raw_rtt`), ``cold`` and ``coldx`` as a lookup and a read, ``put`` as a
    write and a commit."""
    from kvplane.bench.raw_rtt import Servers

    servers = Servers(segments, "c" if side == "raw-c" else "py")
    rows = []
    try:
        for op in ("cold", "coldx", "put"):
            host0 = host_sample()
            lat = sorted(servers.run("put" if op == "put" else "get", opt.keys, opt.size))
            host1 = host_sample()
            rows.append({"side": side, "op": op, "calls": len(lat), "ops": len(lat),
                         "p50_us": lat[len(lat) // 2] / 1e3,
                         "mean_us": sum(lat) / len(lat) / 1e3, "load": host1[0],
                         "steal_pct": steal_pct(host0, host1), "segments": segments,
                         "size": opt.size})
    finally:
        servers.close()
    return rows


def measure_bytes(side: Side, opt: Options) -> list[dict[str, Any]]:
    """``get(key)`` returning bytes, and ``get_into``, cycling over ``opt.working_set``."""
    keys = max(1, opt.working_set // opt.size)
    o = Options(**{**opt.__dict__, "keys": keys})
    rows = []
    for op in ("getb", "getinto"):
        r = _phase(side, op, o)
        rows.append(dict(r, size=opt.size, working_set=keys * opt.size,
                         gb_s=r["ops_s"] * opt.size / 1e9))
    return rows


def run(kind: str, opt: Options, progress: Callable[[str], None] = lambda s: None) -> list[dict]:
    """``kind`` (``cpu``, ``cold`` or ``bytes``) ``opt.repeat`` times, the sides alternating
    (round i starts with the side round i-1 ended with); per cell the median row, with the
    cell's spread and every round's figure."""
    mc = find_mooncake_python(opt.mooncake_python) if "mooncake" in opt.sides else None
    sides = [s for s in opt.sides if s != "mooncake" or mc is not None]
    if "mooncake" in opt.sides and mc is None:
        progress("mooncake not installed: skipped (set KVPLANE_MOONCAKE_PYTHON)")
    if "raw-c" in sides:
        from kvplane.bench.raw_rtt import build_c

        try:
            build_c()
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            progress(f"raw-c skipped: {exc}")
            sides.remove("raw-c")
    rows: list[dict] = []
    for rnd in range(opt.repeat):
        for name in sides if rnd % 2 == 0 else sides[::-1]:
            for segs in opt.segments if kind == "cold" else [1]:
                progress(f"[{rnd + 1}/{opt.repeat}] {kind} {name}"
                         + (f" {segs} segments" if kind == "cold" else ""))
                if name in FLOORS:  # the machine's floor: ``cold`` only
                    if kind == "cold":
                        rows += [dict(r, round=rnd) for r in measure_raw(opt, segs, name)]
                    continue
                svc = Services()
                try:
                    side = start_side(svc, name, opt, mc, segs, held=kind != "cpu")
                    if kind == "cpu":
                        got = [measure_cpu(side, op, opt) for op in opt.ops]
                    elif kind == "cold":
                        got = measure_cold(side, opt, segs)
                    else:
                        got = measure_bytes(side, opt)
                finally:
                    svc.stop()
                rows += [dict(r, round=rnd) for r in got]
    key, figure = FIGURES[kind]
    return median_rows(rows, key, figure)


# per kind: the fields naming a cell, and the figure its median is taken of
FIGURES: dict[str, tuple[tuple[str, ...], str]] = {
    "cpu": (("side", "op"), "cpu_per_100k_s"),
    "cold": (("side", "op", "segments"), "p50_us"),
    "bytes": (("side", "op"), "gb_s"),
}


DEFAULTS = {  # per kind: what a plain run measures
    "cpu": {"size": 4096, "duration": 2.0, "clients": 2, "rate": 5000.0},
    "cold": {"size": 4096, "duration": 2.0, "keys": 2000},
    "bytes": {"size": 1 << 20, "duration": 3.0},
}


def cli(kind: str, argv: list[str] | None = None) -> int:
    """Parse ``argv``, run ``kind``, print one JSON line per median row and per ratio
    (``--json``) or a short table."""
    import argparse

    d = DEFAULTS[kind]
    ap = argparse.ArgumentParser(prog=f"store_scale.py {kind}", description=__doc__)
    ap.add_argument("--sides", default=",".join(SIDES + (("kvplane-shm", *FLOORS) if kind == "cold"
                                                     else ())),
                    help="kvplane, mooncake (both over TCP), kvplane-shm (kvplane's default "
                         "same-host protocol: shared memory)" + (", raw and raw-c (bare round "
                         "trips in Python and in C: the floor)" if kind == "cold" else ""))
    ap.add_argument("--repeat", type=int, default=5, help="interleaved rounds (median)")
    ap.add_argument("--duration", type=float, default=d["duration"], help="seconds per phase")
    ap.add_argument("--size", default=str(d["size"]), help="value size (e.g. 4KiB, 1MiB)")
    ap.add_argument("--segment-mb", type=int, default=2048)
    ap.add_argument("--mooncake-python", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--before", default="", metavar="SRC",
                    help="the src/ of another kvplane tree: adds side 'before', run with it")
    if kind == "cpu":
        ap.add_argument("--ops", default="exists,get,put,bget32,bput32")
        ap.add_argument("--clients", type=int, default=d["clients"])
        ap.add_argument("--rate", type=float, default=d["rate"],
                        help="calls/s of each client (0: as fast as it can)")
        ap.add_argument("--keys", type=int, default=1024)
    if kind == "cold":
        ap.add_argument("--keys", type=int, default=d["keys"], help="keys read cold per round")
        ap.add_argument("--segments", default="1", help="segment processes, e.g. 1,64")
        ap.add_argument("--extra-segment-mb", type=int, default=64)
    if kind == "bytes":
        ap.add_argument("--working-set", default="512MiB",
                        help="bytes of keys the gets cycle over (keep it past the CPU caches)")
    a = ap.parse_args(argv)
    opt = Options(sides=a.sides.split(",") + (["before"] if a.before else []), repeat=a.repeat,
                  duration=a.duration, size=_size(a.size), segment_mb=a.segment_mb,
                  mooncake_python=a.mooncake_python, before=os.path.abspath(a.before)
                  if a.before else "")
    if kind == "cpu":
        opt.ops, opt.clients, opt.rate, opt.keys = a.ops.split(","), a.clients, a.rate, a.keys
    elif kind == "cold":
        opt.keys, opt.extra_segment_mb = a.keys, a.extra_segment_mb
        opt.segments = [int(x) for x in a.segments.split(",")]
    else:
        opt.working_set = _size(a.working_set)
    rows = run(kind, opt, lambda s: print(s, file=sys.stderr, flush=True))
    rat = ratios(kind, rows)
    if a.json:
        for r in rows:
            print(json.dumps({"kind": kind, **r}))
        for r in rat:
            print(json.dumps({"kind": kind, "ratio_of": f"{r['side']}/{r['vs']}", **r}))
        return 0
    key, figure = FIGURES[kind]
    for r in rows:
        cell = " ".join(str(r[k]) for k in key)
        print(f"{kind} {cell}: median {figure} {r['median']:.3f} (min {r['min']:.3f}, max "
              f"{r['max']:.3f}, {r['runs']} runs), load {r['load']:.2f}, steal "
              f"{r['steal_pct']:.1f} %")
    for r in rat:
        cell = " ".join(f"{k}={r[k]}" for k in key[1:])
        print(f"ratio {r['side']}/{r['vs']} {cell}: {r['ratio']:.2f} (target {r['target'] or '-'})")
    return 0


def _size(text: str) -> int:
    from kvplane.common.config import parse_size

    return int(parse_size(text))


def main(argv: list[str] | None = None) -> int:
    """``benchmarks/store_scale.py cpu``."""
    return cli("cpu", argv)
