"""``kvplane bench store``: kvplane vs real Mooncake store vs Redis, side by side in one run.

Topologies: ``remote`` (the segment lives in another process: ``kvplane segment`` /
``mooncake_client``; clients contribute nothing) and ``local`` (the client contributes its own
segment). kvplane runs with protocol ``tcp`` (bytes over TCP even on one host, like Mooncake here)
and ``auto`` (shared memory on one host). Every side runs ``store_loop``'s loop. Sides with
``-csum`` turn store checksums on; sides with ``-nocache`` turn the clients' location cache off
(every get asks the master before it reads: a first get); sides ending in ``-ha`` run etcd and two
HA masters (a leader and a standby) and reach them through ``etcd://`` (the ratio ``vs_non_ha`` is
ops/s over the same side without HA).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvplane.bench.report import Rows, skip
from kvplane.bench.transfer import MOONCAKE_MISSING, best_of, find_mooncake_python, numbered
from kvplane.common.extras import pyplot
from kvplane.common.procs import free_port

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "store_loop.py")
KEY = ("impl", "topology", "clients", "op", "size", "batch")  # one cell of the results


@dataclass
class Options:
    sizes: list[int] = field(default_factory=lambda: [4096, 65536, 1 << 20, 16 << 20])
    batches: list[int] = field(default_factory=lambda: [32])
    duration: float = 1.0
    clients: list[int] = field(default_factory=lambda: [1, 2])
    sides: list[str] = field(default_factory=lambda: ["kvplane-tcp", "kvplane-shm", "mooncake", "redis"])
    topologies: list[str] = field(default_factory=lambda: ["remote", "local"])
    segment_mb: int = 2048
    cap_mb: int = 256
    mooncake_python: str | None = None
    repeat: int = 1  # run every side this many times, interleaved; keep each cell's best
    api: str = "zero-copy"  # "bytes": put/get returning bytes (store_loop --api)
    working_set_mb: int = 0  # the get phase cycles over this many MiB of keys (0: cap_mb's)


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            args: Any = proc.args
            raise RuntimeError(f"{args[0]} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)  # readiness poll on the port
    raise RuntimeError(f"port {port} not ready in {timeout}s")


class Services:
    """Background servers for one side; stopped with SIGTERM then SIGKILL."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.tmp = tempfile.mkdtemp(prefix="kvplane-bench-")

    def start(self, args: list[str], port: int, env: dict[str, str] | None = None) -> None:
        log = open(os.path.join(self.tmp, f"{len(self.procs)}.log"), "w")
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env={**os.environ, **(env or {})})
        log.close()
        self.procs.append(p)
        _wait_port(port, p)

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
        self.procs.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)


def start_kvplane(svc: Services, remote: bool, seg_mb: int, ha: bool = False,
                  protocol: str = "auto") -> str:
    """A kvplane master in ``svc`` (``ha``: etcd, a leader and a standby) and, if ``remote``,
    one ``kvplane segment`` of ``seg_mb`` MiB with ``protocol``; returns the master address
    clients use."""
    port, admin = free_port(), free_port()
    cli = [sys.executable, "-m", "kvplane.cli.main"]
    if ha:  # etcd, a leader and a standby; clients and the segment use the etcd:// address
        from kvplane.bench.services import start_etcd

        etcd = start_etcd(os.path.join(svc.tmp, "etcd"))
        svc.procs.append(etcd.proc)
        ha_args = ["--ha", etcd.url, "--cluster-id", "bench"]
        svc.start([*cli, "master", "--port", str(port), "--admin-port", str(admin), *ha_args],
                  port)
        _wait_leader(admin)
        standby = free_port()
        svc.start([*cli, "master", "--port", str(standby), "--admin-port", "0", *ha_args],
                  standby)
        master = f"{etcd.url}/bench"
    else:
        svc.start([*cli, "master", "--port", str(port), "--admin-port", str(admin)], port)
        master = f"127.0.0.1:{port}"
    if remote:
        ready = os.path.join(svc.tmp, "seg.json")
        p = subprocess.Popen([*cli, "segment", "--master", master, "--size", f"{seg_mb}MiB",
                              "--ready-file", ready, "--protocol", protocol], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        svc.procs.append(p)
        deadline = time.monotonic() + 60
        while not os.path.exists(ready):
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("kvplane segment failed to start")
            time.sleep(0.05)  # readiness poll on the ready file
    return master


def _wait_leader(admin: int, timeout: float = 30.0) -> None:
    import httpx

    from kvplane.common.auth import token_headers

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{admin}/ha_status", timeout=1, trust_env=False,
                         headers=token_headers()).json().get("role") == "leader":
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)  # readiness poll on the leader's status
    raise RuntimeError(f"no HA leader within {timeout}s")


def start_mooncake(svc: Services, py: str, remote: bool, seg_mb: int) -> tuple[str, str]:
    """A Mooncake master (with its HTTP metadata server) and, when ``remote``, a store server of
    ``seg_mb`` MB; (master address, metadata URL)."""
    pkg = subprocess.run([py, "-c", "import mooncake,os;print(os.path.dirname(mooncake.__file__))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    port, meta, metrics, srv = free_port(), free_port(), free_port(), free_port()
    env = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "GLOG_minloglevel": "2"}
    svc.start([f"{pkg}/mooncake_master", "--rpc_address=127.0.0.1", f"--rpc_port={port}",
               "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
               f"--http_metadata_server_port={meta}", "--metrics_host=127.0.0.1",
               f"--metrics_port={metrics}"], port, env)
    _wait_port(meta, svc.procs[-1])
    url = f"http://127.0.0.1:{meta}/metadata"
    if remote:
        svc.start([f"{pkg}/mooncake_client", "--host=127.0.0.1", f"--port={srv}",
                   f"--global_segment_size={seg_mb} MB", "--local_buffer_size=0", "--protocol=tcp",
                   f"--master_server_address=127.0.0.1:{port}", f"--metadata_server={url}"], srv, env)
    return f"127.0.0.1:{port}", url


def _redis(svc: Services) -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        raise FileNotFoundError("redis-server not installed")
    port = free_port()
    svc.start([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--maxmemory", "4gb"], port)
    return f"127.0.0.1:{port}"


def _worker(py: str, impl: str, label: str, master: str, opt: Options, clients: int,
            protocol: str = "tcp", metadata: str = "P2PHANDSHAKE", segment_mb: int = 0,
            extra_env: dict[str, str] | None = None) -> list[dict]:
    cmd = [py, WORKER, "--impl", impl, "--label", label, "--master", master, "--metadata", metadata,
           "--protocol", protocol, "--clients", str(clients), "--segment-mb", str(segment_mb),
           "--sizes", ",".join(map(str, opt.sizes)), "--batch", ",".join(map(str, opt.batches)),
           "--duration", str(opt.duration), "--cap-mb", str(opt.cap_mb),
           "--local-buffer-mb", str(max(64, max(opt.batches) * max(opt.sizes) >> 20)),
           "--api", opt.api, "--working-set-mb", str(opt.working_set_mb)]
    env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1", GLOG_minloglevel="2", **(extra_env or {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    rows = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not rows or not all(r["verified"] for r in rows):
        raise RuntimeError(f"{label} failed rc={proc.returncode}: {proc.stderr[-3000:]}")
    return rows


def run(opt: Options, progress: Callable[[str], None] = lambda s: None,
        sink: list[dict] | None = None) -> list[dict]:
    """Measure everything ``opt.repeat`` times (interleaved); best row per cell. ``sink`` gets
    every row as it is measured (what a Ctrl-C leaves: ``best_of([sink], KEY)``)."""
    runs = [run_once(opt, numbered(progress, i, opt.repeat), sink)
            for i in range(max(1, opt.repeat))]
    return best_of(runs, KEY)


def steps(opt: Options) -> int:
    """How many times ``run`` calls ``progress`` with a step (skip lines not counted)."""
    one = (len(opt.sizes) if "local" in opt.topologies else 0) \
        + (len(opt.sizes) * (1 + len(opt.batches)) if "remote" in opt.topologies else 0) \
        + len(_cells(opt, find_mooncake_python(opt.mooncake_python)))
    return one * max(1, opt.repeat)


def skipped(opt: Options, mooncake_python: str | None) -> dict[str, str]:
    """The sides asked for that cannot run here, with why."""
    from kvplane.transfer.fabric import INSTALL_HINT, nixl_package

    out = {}
    for side in opt.sides:
        if side == "mooncake" and mooncake_python is None:
            out[side] = MOONCAKE_MISSING
        elif side == "redis" and shutil.which("redis-server") is None:
            out[side] = "redis-server is not installed (apt-get install redis-server)"
        elif side.endswith("-ha") and shutil.which("etcd") is None:
            out[side] = "etcd is not installed (apt-get install etcd-server)"
        elif side.startswith("kvplane-nixl") and nixl_package() is None:
            out[side] = f"NIXL is not installed ({INSTALL_HINT})"
        elif side == "redis" and "remote" not in opt.topologies:
            out[side] = "Redis runs in the remote topology only"
    return out


def run_once(opt: Options, progress: Callable[[str], None] = lambda s: None,
             sink: list[dict] | None = None) -> list[dict]:
    """Measure every (side, topology, clients) once; rows carry ``topology``."""
    rows: list[dict] = Rows(sink)
    mc = find_mooncake_python(opt.mooncake_python) if "mooncake" in opt.sides else None
    for side, why in skipped(opt, mc).items():
        progress(skip(side, why))
    if "local" in opt.topologies:
        rows += _memcpy_rows(opt, progress)
    if "remote" in opt.topologies:
        rows += _floor_rows(opt, progress)
    for cell in _cells(opt, mc):
        progress(f"{cell.side} {cell.topology} x{cell.clients}")
        rows += _measure(cell, opt, mc)
    return list(rows)


@dataclass(frozen=True)
class _Cell:
    """One measured combination."""

    side: str
    topology: str
    clients: int


def _cells(opt: Options, mooncake_python: str | None) -> list[_Cell]:
    """Every combination to measure, in run order. Several clients only in the remote topology
    (a local client contributes its own segment); Redis only remote (it has no local mode);
    no side that cannot run here (``skipped``)."""
    cells = []
    left_out = skipped(opt, mooncake_python)
    for topology in opt.topologies:
        for clients in opt.clients if topology == "remote" else [1]:
            cells += [_Cell(side, topology, clients) for side in opt.sides
                      if not (side == "redis" and topology != "remote") and side not in left_out]
    return cells


def _memcpy_rows(opt: Options, progress: Callable[[str], None]) -> list[dict]:
    """The machine's limit for a same-host get: one memcpy per value size."""
    from kvplane.bench import limits

    rows = []
    for size in opt.sizes:
        progress(f"memcpy {size}")
        rows.append(dict(impl="memcpy", topology="local", clients=1, op="get", size=size,
                         batch=1, p50_us=float("nan"), p99_us=float("nan"), verified=True,
                         **limits.memcpy(size, max(size, 256 << 20), opt.duration)))
    return rows


def _floor_rows(opt: Options, progress: Callable[[str], None]) -> list[dict]:
    """The floor of a remote get of a call's bytes: one raw socket round trip (limits.round_trip)."""
    from kvplane.bench import limits

    rows = []
    for size in opt.sizes:
        for k in (1, *opt.batches):
            progress(f"floor {size} x{k}")
            lat = sorted(limits.round_trip(size * k, opt.duration))
            el = sum(lat) / 1e9
            rows.append(dict(impl="floor", topology="remote", clients=1, op="get", size=size, batch=k,
                             ops_s=len(lat) * k / el, gb_s=len(lat) * k * size / el / 1e9,
                             p50_us=lat[len(lat) // 2] / 1e3, p99_us=lat[int(0.99 * (len(lat) - 1))] / 1e3,
                             verified=True))
    return rows


def _measure(cell: _Cell, opt: Options, mooncake_python: str | None) -> list[dict]:
    """Start the side's servers, run its worker process, stop the servers."""
    svc = Services()
    try:
        got = _run_side(svc, cell, opt, mooncake_python)
    finally:
        svc.stop()
    return [dict(r, topology=cell.topology) for r in got]


def _run_side(svc: Services, cell: _Cell, opt: Options, mooncake_python: str | None) -> list[dict]:
    remote = cell.topology == "remote"
    segment_mb = 0 if remote else opt.segment_mb // 2  # a local client contributes this much
    if cell.side.startswith("kvplane"):
        # "-ha" sides: etcd and two masters (leader + standby), clients follow etcd://
        # kvplane-nixl: clients and the pool's segment over NIXL/UCX (issue 30)
        protocol = "tcp" if cell.side.startswith("kvplane-tcp") else \
            "nixl" if cell.side.startswith("kvplane-nixl") else "auto"
        master = start_kvplane(svc, remote, opt.segment_mb, ha=cell.side.endswith("-ha"),
                          protocol=protocol)  # the segment as its clients: a tcp side loads no NIXL
        # "-csum" sides: the same client with store checksums on (their cost, side by side)
        env = {"KVPLANE_STORE_CHECKSUM": "1" if "-csum" in cell.side else "0"}
        if "-nocache" in cell.side:  # no speculative gets: the lookup, then the read
            env["KVPLANE_STORE_LOCATION_CACHE"] = "0"
        return _worker(sys.executable, "kvplane", cell.side, master, opt, cell.clients, protocol,
                       segment_mb=segment_mb, extra_env=env)
    if cell.side == "mooncake":
        assert mooncake_python is not None  # _cells skips Mooncake when it is not installed
        master, url = start_mooncake(svc, mooncake_python, remote, opt.segment_mb)
        return _worker(mooncake_python, "mooncake", cell.side, master, opt, cell.clients, "tcp", url,
                       segment_mb)
    return _worker(sys.executable, "redis", cell.side, _redis(svc), opt, cell.clients)


def ratios(rows: list[dict]) -> list[dict]:
    """kvplane (tcp and shm) over Mooncake and over Redis, per cell."""
    idx = {(r["impl"], r["topology"], r["clients"], r["op"], r["size"], r["batch"]): r for r in rows}
    out = []
    for r in rows:
        if not r["impl"].startswith("kvplane"):
            continue
        key = (r["topology"], r["clients"], r["op"], r["size"], r["batch"])
        mc, rd = idx.get(("mooncake", *key)), idx.get(("redis", *key))
        plain = idx.get((r["impl"].removesuffix("-ha"), *key)) if r["impl"].endswith("-ha") \
            else None
        fl = idx.get(("floor", *key)) if r["clients"] == 1 else None
        cp = idx.get(("memcpy", "local", 1, "get", r["size"], 1)) if r["topology"] == "local" \
            and r["op"] == "get" and r["batch"] == 1 else None
        out.append(dict(side=r["impl"], topology=r["topology"], clients=r["clients"], op=r["op"],
                        size=r["size"], batch=r["batch"], gb_s=r["gb_s"], ops_s=r["ops_s"],
                        vs_mooncake=r["gb_s"] / mc["gb_s"] if mc else None,
                        vs_redis=r["gb_s"] / rd["gb_s"] if rd else None,
                        vs_floor=r["gb_s"] / fl["gb_s"] if fl else None,
                        vs_memcpy=r["gb_s"] / cp["gb_s"] if cp else None,
                        vs_non_ha=r["ops_s"] / plain["ops_s"] if plain else None))
    return out


def plot(rows: list[dict], path: str) -> None:
    """GB/s vs value size per side, one panel per (op, batch), remote topology, 1 client."""
    plt = pyplot()

    cells = {(r["op"], r["batch"]) for r in rows if r["topology"] == "remote" and r["clients"] == 1
             and r["impl"] not in ("floor", "memcpy")}
    panels = [p for p in [(op, b) for b in sorted({b for _, b in cells}) for op in ("put", "get")]
              if p in cells] or [("get", 1)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4), sharey=False,
                             squeeze=False)
    for ax, (op, b) in zip(axes[0], panels):
        for side in sorted({r["impl"] for r in rows}):
            pts = sorted((r["size"], r["gb_s"]) for r in rows if r["impl"] == side and r["op"] == op
                         and r["batch"] == b and r["topology"] == "remote" and r["clients"] == 1)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=side)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{op} batch={b} (remote, 1 client)")
        ax.set_xlabel("value size (bytes)")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    axes[0][0].set_ylabel("GB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
