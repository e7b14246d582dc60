"""``benchmarks/store_scale.py placement``: the master's cost of one put as the pool gains
segments, in one process (the master's own operations, without RPC).

Each measurement is a fresh :class:`~kvplane.store.master.state.MasterState` with ``N``
segments of 256 MiB mounted (``--segments 1,64,1024``); per put:

* ``spare``: a spare's commit under a new key and the grant of the next spare (what a PutEnd
  of a client putting one object after another costs the master; ``spares.py``);
* ``put``: ``put_start`` and ``put_end`` of a new key (one replica);
* ``preferred``: the same with ``preferred_segment`` naming one of the segments (what LMCache
  and vLLM's Mooncake connector ask for: their own host's segment first).

``--before SRC`` runs the same, in its own interpreter, against another kvplane tree's
``src/`` (an A/B of a change). Sides alternate within each of ``--repeat`` rounds (this tree
first in even rounds); each cell is the median over the rounds of microseconds per put. The
worker (``--worker``) imports only the master's state, spares and the store's types, which every
tree since spares has.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

SEG = 256 << 20


def measure(segments: int, puts: int) -> dict[str, float]:
    """Microseconds per put on a fresh master with ``segments`` segments mounted."""
    from kvplane.store.inventory import header_len
    from kvplane.store.master import spares
    from kvplane.store.master.config import MasterConfig
    from kvplane.store.master.state import MasterState
    from kvplane.store.types import ReplicateConfig, SegmentInfo, SpareAsk

    st = MasterState(MasterConfig(), seed=1)
    for i in range(segments):
        st.mount(f"c{i}", [SegmentInfo(f"s{i}", (i + 1) << 40, SEG, "", f"127.0.0.1:{i + 1}",
                                       "bench-host")], 0.0)
    cfg = ReplicateConfig()
    ask = SpareAsk(4096, header_len(f"key-{0:09d}"), cfg)
    got = spares.grant(st, "w", ask, 0.0, frozenset(), 10.0)
    if got is None:
        raise RuntimeError("no spare granted")
    name, res = got
    t0 = time.perf_counter()
    for i in range(puts):
        if spares.commit(st, "w", name, f"key-{i:09d}", res.version, 0, 1.0):
            raise RuntimeError("a spare's commit failed")
        got = spares.grant(st, "w", ask, 1.0, frozenset(), 10.0)
        if got is None:
            raise RuntimeError("no spare granted")
        name, res = got
    spare = time.perf_counter() - t0
    put = _puts(st, "put", cfg, 2.0, puts)
    preferred = _puts(st, "pref", ReplicateConfig(preferred_segment=f"s{segments - 1}"), 3.0,
                      puts)
    return {"spare": spare / puts * 1e6, "put": put / puts * 1e6,
            "preferred": preferred / puts * 1e6}


def _puts(st: Any, prefix: str, cfg: Any, now: float, puts: int) -> float:
    """Seconds for ``puts`` ``put_start`` + ``put_end`` of new keys with ``cfg``."""
    t0 = time.perf_counter()
    for i in range(puts):
        key = f"{prefix}-{i:09d}"
        r = st.put_start(key, 4096, cfg, now)
        if r.code or st.put_end(key, now, r.version):
            raise RuntimeError(f"put of {key} failed")
    return time.perf_counter() - t0


def _worker(a: argparse.Namespace) -> int:
    import kvplane

    out: dict[str, Any] = {str(n): measure(n, a.puts) for n in a.segment_counts}
    out["src"] = os.path.dirname(os.path.dirname(os.path.abspath(kvplane.__file__)))
    print(json.dumps(out), flush=True)
    return 0


def _run_side(src: str | None, a: argparse.Namespace) -> dict[str, dict[str, float]]:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker",
                          "--segments", a.segments, "--puts", str(a.puts)],
                         env=env, capture_output=True, text=True, timeout=600, check=True)
    got = dict(json.loads(out.stdout.strip().splitlines()[-1]))
    ran = got.pop("src")
    if src and os.path.realpath(ran) != os.path.realpath(src):
        raise RuntimeError(f"the worker imported kvplane from {ran}, not {src}")
    return got


def main(argv: list[str] | None = None) -> int:
    """Command line of ``benchmarks/store_scale.py placement``."""
    ap = argparse.ArgumentParser(prog="store_scale.py placement",
                                 description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--segments", default="1,64,1024", help="segment counts, e.g. 1,64,1024")
    ap.add_argument("--puts", type=int, default=20_000, help="puts per measurement")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--before", default="", metavar="SRC",
                    help="the src/ of another kvplane tree: adds side 'before'")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.segment_counts = [int(x) for x in a.segments.split(",") if x]
    if a.worker:
        return _worker(a)
    from kvplane.bench.store_scale_memory import cpu_times, host_load

    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sides = {"kvplane": here, **({"before": a.before} if a.before else {})}
    seen: dict[tuple[str, int, str], list[float]] = {}
    host0 = cpu_times()
    for rep in range(a.repeat):
        order = list(sides) if rep % 2 == 0 else list(sides)[::-1]
        for side in order:
            for n, cells in _run_side(sides[side], a).items():
                for op, us in cells.items():
                    seen.setdefault((side, int(n), op), []).append(us)
    load = host_load(host0)
    for op in ("spare", "put", "preferred"):
        base = statistics.median(seen[("kvplane", a.segment_counts[0], op)])
        for n in a.segment_counts:
            row: dict[str, Any] = {"op": op, "segments": n, "repeat": a.repeat}
            for side in sides:
                row[f"{side}_us"] = round(statistics.median(seen[(side, n, op)]), 2)
            row["kvplane_over_fewest"] = round(row["kvplane_us"] / base, 2)
            if "before" in sides:
                row["before_over_kvplane"] = round(row["before_us"] / row["kvplane_us"], 2)
            row.update(load)
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
