"""``kvplane bench transfer``: kvplane tcp/shm/nixl vs real Mooncake and bare NIXL vs the
machine's limits, in one run.

Every side runs the same loop (``te_worker.run_cells``) in two processes. Real Mooncake is
measured when an interpreter with ``mooncake`` is found (``--mooncake-python`` or
/tmp/mc-venv/bin/python); the NIXL sides when ``nixl_cu12`` is installed: ``kvplane-nixl``
(kvplane's engine, protocol ``nixl``) and ``nixl-raw`` (two bare ``nixl_agent`` s,
``nixl_worker``), each with UCX's default transports or, suffixed, a fixed ``UCX_TLS``
(:data:`UCX_VARIANTS`).
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvplane.bench import limits
from kvplane.bench.report import Rows, skip
from kvplane.common.extras import pyplot

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "te_worker.py")
NIXL_WORKER = os.path.join(HERE, "nixl_worker.py")
DEFAULT_MC_PYTHON = "/tmp/mc-venv/bin/python"
# the NIXL sides' suffixes: "" runs under UCX's own choice of transports (UCX_TLS unset)
UCX_VARIANTS = {"": "", "-shmtcp": "shm,tcp", "-tcp": "tcp"}
NIXL_SIDE = re.compile(r"^(kvplane-nixl|nixl-raw)(|-shmtcp|-tcp)$")
KEY = ("impl", "op", "size", "batch")  # one cell of the results
MOONCAKE_MISSING = ("no interpreter here imports mooncake (this one, --mooncake-python, "
                    "KVPLANE_MOONCAKE_PYTHON, /tmp/mc-venv/bin/python): pip install "
                    "mooncake-transfer-engine-non-cuda (docs/benchmarks.md)")


@dataclass
class Options:
    """What to measure."""

    sizes: list[int] = field(default_factory=lambda: [4096, 65536, 1 << 20, 16 << 20, 64 << 20])
    batches: list[int] = field(default_factory=lambda: [1, 32])
    ops: list[str] = field(default_factory=lambda: ["write", "read"])
    buf_mb: int = 512
    duration: float = 1.0
    mooncake_python: str | None = None
    impls: list[str] = field(default_factory=lambda: ["limits", "kvplane-tcp", "kvplane-shm", "mooncake-tcp",
                                                      "kvplane-nixl", "nixl-raw"])
    repeat: int = 1  # run every side this many times, interleaved
    stat: str = "best"  # per cell over the repeats: "best" (highest GB/s) or "median"


def find_mooncake_python(hint: str | None) -> str | None:
    """An interpreter that can import real Mooncake (``mooncake.engine``), or None: ``hint``,
    ``KVPLANE_MOONCAKE_PYTHON``, this interpreter, then /tmp/mc-venv/bin/python."""
    return _find_mooncake(hint, os.environ.get("KVPLANE_MOONCAKE_PYTHON"))


@functools.lru_cache(maxsize=8)
def _find_mooncake(hint: str | None, env: str | None) -> str | None:
    for cand in (hint, env):
        if cand and (shutil.which(cand) or os.path.exists(cand)) and _imports_mooncake(cand):
            return cand
    if _here_has_mooncake():
        return sys.executable
    return DEFAULT_MC_PYTHON if os.path.exists(DEFAULT_MC_PYTHON) and \
        _imports_mooncake(DEFAULT_MC_PYTHON) else None


def _imports_mooncake(python: str) -> bool:
    return subprocess.run([python, "-c", "import mooncake.engine"], capture_output=True,
                          timeout=60).returncode == 0


def _here_has_mooncake() -> bool:
    """Real Mooncake is installed for this interpreter (kvplane's own ``mooncake`` import shim,
    which maps Mooncake's names onto kvplane, does not count)."""
    # every place on sys.path, not find_spec's first answer: a ``mooncake`` already imported in
    # this process (the shim, by an earlier caller) or a shim earlier on the path would hide it
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the kvplane package
    for entry in sys.path:
        spec = importlib.machinery.PathFinder.find_spec("mooncake", [entry or os.getcwd()])
        for where in (spec.submodule_search_locations or []) if spec else []:
            if os.path.abspath(where).startswith(ours) or not os.path.isdir(where):
                continue  # the shim, or nothing there
            if any(name.startswith("engine") for name in os.listdir(where)):
                return True
    return False


def _worker(python: str, impl: str, protocol: str, label: str, opt: Options,
            managed: bool = False, timeout: float = 1200, script: str = WORKER,
            ucx_tls: str | None = None) -> list[dict]:
    """Run one side's worker; its cell rows (the final verified row checked and dropped).
    ``ucx_tls``: None leaves UCX_TLS as it is, "" unsets it, else sets it."""
    cmd = [python, script, "--label", label, "--sizes", ",".join(map(str, opt.sizes)),
           "--batches", ",".join(map(str, opt.batches)), "--ops", ",".join(opt.ops),
           "--buf-mb", str(opt.buf_mb), "--duration", str(opt.duration)]
    if script == WORKER:
        cmd += ["--impl", impl, "--protocol", protocol]
    if managed:
        cmd.append("--managed")
    env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1", GLOG_minloglevel="2")
    if ucx_tls is not None:
        env.pop("UCX_TLS", None)
        if ucx_tls:
            env["UCX_TLS"] = ucx_tls
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not rows or not rows[-1].get("verified"):
        raise RuntimeError(f"{label} worker failed (rc={proc.returncode}): {proc.stderr[-2000:]}")
    moved = rows[-1].get("slices")
    if protocol == "nixl" and not (moved or {}).get("nixl"):
        raise RuntimeError(f"{label}: no slice went over the nixl transport ({moved})")
    return rows[:-1]


def best_of(runs: list[list[dict]], key: tuple[str, ...]) -> list[dict]:
    """Merge repeated runs: per cell (``key`` fields) keep the row with the highest GB/s."""
    return merged(runs, key, "best")


def merged(runs: list[list[dict]], key: tuple[str, ...], stat: str) -> list[dict]:
    """Merge repeated runs per cell (``key`` fields): the row with the highest GB/s
    (``stat="best"``) or the median one (``"median"``; the lower middle for an even count),
    with ``runs`` and the cell's spread (``gb_s_min``, ``gb_s_max``)."""
    cells: dict[tuple, list[dict]] = {}
    for rows in runs:
        for r in rows:
            cells.setdefault(tuple(r.get(f) for f in key), []).append(r)
    out = []
    for rows in cells.values():
        rows = sorted(rows, key=lambda r: r["gb_s"])
        pick = rows[-1] if stat == "best" else rows[(len(rows) - 1) // 2]
        out.append(dict(pick, runs=len(rows), gb_s_min=rows[0]["gb_s"], gb_s_max=rows[-1]["gb_s"]))
    return out


def numbered(progress: Callable[[str], None], i: int, n: int) -> Callable[[str], None]:
    """``progress`` that prefixes ``[i+1/n]``: the lines of round ``i`` of ``n`` repeats."""
    return lambda s: progress(f"[{i + 1}/{n}] {s}")


def run(opt: Options, progress: Callable[[str], None] = lambda s: None,
        sink: list[dict] | None = None) -> list[dict]:
    """Measure every side ``opt.repeat`` times (interleaved: round i runs every side before
    round i+1 starts); per cell the best or the median row (``opt.stat``). ``sink`` gets
    every row as it is measured (what a Ctrl-C leaves: ``merged([sink], KEY, opt.stat)``)."""
    if opt.stat not in ("best", "median"):
        raise ValueError(f"stat {opt.stat!r}: choose best or median")
    runs = []
    for i in range(max(1, opt.repeat)):
        runs.append(run_once(opt, numbered(progress, i, opt.repeat), sink))
    return merged(runs, KEY, opt.stat)


def steps(opt: Options) -> int:
    """How many times ``run`` calls ``progress`` with a step (skip lines not counted)."""
    from kvplane.transfer.fabric import nixl_package

    one = (len(opt.sizes) if "limits" in opt.impls else 0) \
        + sum(side in opt.impls for side in ("kvplane-tcp", "kvplane-shm")) \
        + ("mooncake-tcp" in opt.impls and find_mooncake_python(opt.mooncake_python) is not None) \
        + (sum(_variant(i) is not None for i in opt.impls) if nixl_package() is not None else 0)
    return one * max(1, opt.repeat)


def run_once(opt: Options, progress: Callable[[str], None] = lambda s: None,
             sink: list[dict] | None = None) -> list[dict]:
    """Measure every side once; returns one row per (impl, op, size, batch)."""
    rows: list[dict] = Rows(sink)
    if "limits" in opt.impls:
        for size in opt.sizes:
            progress(f"limits {size}")
            buf = max(size, min(opt.buf_mb << 20, 256 << 20))
            rows.append(dict(impl="memcpy", op="copy", size=size, batch=1,
                             **limits.memcpy(size, buf, opt.duration)))
            rows.append(dict(impl="raw-socket", op="stream", size=size, batch=1,
                             **limits.raw_stream(size, opt.duration)))
    if "kvplane-tcp" in opt.impls:
        progress("kvplane tcp")
        rows += _worker(sys.executable, "kvplane", "tcp", "kvplane-tcp", opt)
    if "kvplane-shm" in opt.impls:
        progress("kvplane shm")
        rows += _worker(sys.executable, "kvplane", "auto", "kvplane-shm", opt, managed=True)
    if "mooncake-tcp" in opt.impls:
        mc = find_mooncake_python(opt.mooncake_python)
        if mc is None:
            progress(skip("mooncake-tcp", MOONCAKE_MISSING))
        else:
            progress("mooncake tcp")
            rows += _worker(mc, "mooncake", "tcp", "mooncake-tcp", opt)
    nixl = [i for i in opt.impls if _variant(i) is not None]
    if nixl:
        rows += _nixl_sides(nixl, opt, progress)
    return list(rows)



def _variant(impl: str) -> str | None:
    """The UCX variant suffix of a NIXL side ("" for UCX's default), None for other sides."""
    m = NIXL_SIDE.match(impl)
    return m.group(2) if m else None


def _nixl_sides(impls: list[str], opt: Options, progress: Callable[[str], None]) -> list[dict]:
    """The NIXL sides asked for, or one skip line when ``nixl_cu12`` is not installed."""
    from kvplane.transfer.fabric import INSTALL_HINT, nixl_package

    if nixl_package() is None:
        for impl in impls:
            progress(skip(impl, f"NIXL is not installed ({INSTALL_HINT})"))
        return []
    rows: list[dict] = []
    for impl in impls:
        tls = UCX_VARIANTS[_variant(impl) or ""]
        progress(f"{impl} (UCX_TLS={tls or 'unset'})")
        if impl.startswith("nixl-raw"):
            got = _worker(sys.executable, "nixl", "", impl, opt, script=NIXL_WORKER, ucx_tls=tls)
        else:
            got = _worker(sys.executable, "kvplane", "nixl", impl, opt, ucx_tls=tls)
        rows += [dict(r, ucx_tls=tls or "default") for r in got]
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """Per (op, size, batch): kvplane tcp vs raw socket and vs Mooncake; shm vs memcpy (rows
    ``side="kvplane-tcp"``); then the NIXL rows of :func:`nixl_ratios`."""
    idx = {(r["impl"], r["op"], r["size"], r["batch"]): r for r in rows}
    lim = {(r["impl"], r["size"]): r for r in rows if r["impl"] in ("memcpy", "raw-socket")}
    out = []
    for r in rows:
        if r["impl"] != "kvplane-tcp":
            continue
        key = (r["op"], r["size"], r["batch"])
        mc = idx.get(("mooncake-tcp", *key))
        shm = idx.get(("kvplane-shm", *key))
        raw = lim.get(("raw-socket", r["size"]))
        cpy = lim.get(("memcpy", r["size"]))
        out.append(dict(
            side="kvplane-tcp", op=r["op"], size=r["size"], batch=r["batch"],
            tcp_gb_s=r["gb_s"], tcp_ops_s=r["ops_s"],
            tcp_vs_raw=r["gb_s"] / raw["gb_s"] if raw else None,
            tcp_vs_mooncake=r["gb_s"] / mc["gb_s"] if mc else None,
            mooncake_gb_s=mc["gb_s"] if mc else None,
            shm_gb_s=shm["gb_s"] if shm else None,
            shm_vs_memcpy=shm["gb_s"] / cpy["gb_s"] if shm and cpy else None,
        ))
    return out + nixl_ratios(rows)


def _ratio(a: dict | None, b: dict | None) -> float | None:
    return a["gb_s"] / b["gb_s"] if a and b and b["gb_s"] else None


def nixl_ratios(rows: list[dict]) -> list[dict]:
    """Per UCX variant and (op, size, batch): kvplane nixl vs bare NIXL (same UCX_TLS), and
    each vs the raw socket and memcpy of the block size."""
    idx = {(r["impl"], r["op"], r["size"], r["batch"]): r for r in rows}
    lim = {(r["impl"], r["size"]): r for r in rows if r["impl"] in LIMITS}
    cells = sorted({(v, r["op"], r["size"], r["batch"])
                    for r in rows if (v := _variant(r["impl"])) is not None},
                   key=lambda c: (c[0], c[2], c[1] != "write", c[3]))
    out = []
    for suffix, op, size, batch in cells:
        kv = idx.get((f"kvplane-nixl{suffix}", op, size, batch))
        raw = idx.get((f"nixl-raw{suffix}", op, size, batch))
        sock, cpy = lim.get(("raw-socket", size)), lim.get(("memcpy", size))
        out.append(dict(
            side=f"nixl{suffix}", ucx_tls=UCX_VARIANTS[suffix] or "default", op=op, size=size,
            batch=batch, kvplane_gb_s=kv["gb_s"] if kv else None,
            kvplane_ops_s=kv["ops_s"] if kv else None, raw_gb_s=raw["gb_s"] if raw else None,
            raw_ops_s=raw["ops_s"] if raw else None, kvplane_vs_raw=_ratio(kv, raw),
            kvplane_vs_socket=_ratio(kv, sock), raw_vs_socket=_ratio(raw, sock),
            kvplane_vs_memcpy=_ratio(kv, cpy), raw_vs_memcpy=_ratio(raw, cpy)))
    return out


LIMITS = ("raw-socket", "memcpy")
COLORS = {"kvplane-tcp": "tab:blue", "kvplane-shm": "tab:green", "mooncake-tcp": "tab:red",
          "kvplane-nixl": "tab:orange", "kvplane-nixl-shmtcp": "tab:brown",
          "kvplane-nixl-tcp": "tab:pink", "nixl-raw": "tab:olive", "nixl-raw-shmtcp": "tab:cyan",
          "nixl-raw-tcp": "tab:gray", "raw-socket": "0.35", "memcpy": "0.65"}


def layout(rows: list[dict]) -> tuple[str, dict[str, list[tuple[str, str, list[tuple[int, float]]]]]]:
    """(title, {direction: [(label, linestyle, [(size, GB/s)])]}) of the plot.

    One panel per direction that has measured engine rows (never an empty panel); the limits
    (raw socket, memcpy) are drawn on each; every series has a label; the title names only the
    sides that ran (no "vs Mooncake" when it was skipped).
    """
    engines = [r for r in rows if r["impl"] not in LIMITS and r.get("gb_s")]
    limits = [r for r in rows if r["impl"] in LIMITS and r.get("gb_s")]
    ops = [op for op in ("write", "read") if any(r["op"] == op for r in engines)] or ["limits"]
    panels: dict[str, list[tuple[str, str, list[tuple[int, float]]]]] = {}
    for op in ops:
        series: dict[tuple[str, bool], list[tuple[int, float]]] = {}
        for r in [r for r in engines if r["op"] == op] + limits:
            series.setdefault((r["impl"], r["batch"] > 1), []).append((r["size"], r["gb_s"]))
        panels[op] = [
            (impl if impl in LIMITS else f"{impl} {'batch' if batched else 'single'}",
             ":" if impl in LIMITS else ("--" if batched else "-"), sorted(pts))
            for (impl, batched), pts in sorted(series.items())]
    sides = ["kvplane transfer engine"]
    if any(r["impl"].startswith("mooncake") for r in engines):
        sides.append("Mooncake TCP")
    if any(r["impl"].startswith("nixl-raw") for r in engines):
        sides.append("NIXL raw")
    if limits:
        sides.append("the machine's limits")
    return " vs ".join(sides), panels


def plot(rows: list[dict], path: str) -> Any:
    """GB/s vs block size: one panel per measured direction; colour = side, dashed = batched
    calls; the machine's limits (raw socket, memcpy) dotted on every panel. Returns the figure
    (closed) for inspection."""
    plt = pyplot()
    title, panels = layout(rows)
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5), sharey=True,
                             squeeze=False)
    for ax, (op, series) in zip(axes[0], panels.items()):
        for label, style, pts in series:
            impl = label.split()[0]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=4,
                    color=COLORS.get(impl, "tab:purple"), linestyle=style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (bytes)")
        ax.set_title(op)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("GB/s")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig
