"""A/B of two kvplane source trees on the conductor's query path over HTTP, alternating, so
machine load falls on both alike.

Each tree serves its own conductor process (same index: ``--blocks`` blocks over ``--instances``
instances, one of which holds the whole prompt, as in benchmarks/conductor.py). One httpx client
takes turns: ``--per-turn`` queries to one server, then the other, for ``--rounds`` rounds, the
order flipped every round. Prints each tree's latency percentiles over all its queries and
after/before, for ``/query`` (token ids) and ``/query_by_hash``.

Usage: python benchmarks/conductor_ab.py --before /path/to/old/src --after /path/to/new/src
           [--rounds 20] [--per-turn 10] [--prompt-tokens 32768] [--prompts 1]

With ``--prompts N`` the token queries cycle through N distinct prompts (all indexed): more than
a tree's prefix cache holds (64 x 32k-token prompts) measures cold hashing; 1 measures a
repeated prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time


def serve(n_blocks: int, n_inst: int, prompt_tokens: int, bs: int, n_prompts: int) -> int:
    """One tree's conductor, filled like benchmarks/conductor.py; prints its URL, serves until EOF.
    Prompts after the first are held whole by the last instance."""
    from kvplane.conductor.config import ConductorConfig
    from kvplane.conductor.hashing import HashProfile
    from kvplane.conductor.indexer import ContextKey, Holder
    from kvplane.conductor.server import ConductorServer
    from kvplane.conductor.service import Registration
    from kvplane.kvevents import Tier

    tokens = prompt(prompt_tokens)
    hashes = list(HashProfile().event_hashes(tokens, bs))
    extra = [h for k in range(1, n_prompts) for h in HashProfile().event_hashes(prompt(prompt_tokens, k), bs)]
    rng = random.Random(3)
    with ConductorServer(ConductorConfig(port=0)) as srv:
        c, ctx, per = srv.conductor, ContextKey("default", "m", "", bs, ""), n_blocks // n_inst
        for k in range(n_inst):
            c.register(Registration(f"i{k}", "m", bs))
            share = hashes[: len(hashes) * (k + 1) // n_inst] + (extra if k == n_inst - 1 else [])
            with c._lock:  # direct fill, as the main benchmark does
                c.index.store(ctx, Holder(f"i{k}", 0, Tier.GPU),
                              share + [rng.getrandbits(64) for _ in range(max(0, per - len(share)))])
        print(srv.url, json.dumps(hashes), flush=True)
        sys.stdin.read()
    return 0


def prompt(n: int, k: int = 0) -> list[int]:
    """Benchmark prompt ``k`` (the same on both sides)."""
    rng = random.Random(4 + 1000 * k)
    return [rng.randrange(32000) for _ in range(n)]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> int:
    """Run the A/B and print the table. Returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--per-turn", type=int, default=10)
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--instances", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=32_768)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=1,
                    help="distinct prompts, cycled; more than a prefix cache holds = cold hashing")
    a = ap.parse_args(argv)
    import httpx

    sides, procs, urls = ("before", "after"), {}, {}
    args = [str(a.blocks), str(a.instances), str(a.prompt_tokens), str(a.block_size), str(a.prompts)]
    try:
        for side in sides:
            env = {**os.environ, "PYTHONPATH": os.path.abspath(getattr(a, side))}
            procs[side] = subprocess.Popen([sys.executable, __file__, "--serve", *args], env=env,
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        bodies = {}
        for side in sides:
            url, hashes = procs[side].stdout.readline().split(" ", 1)  # type: ignore[union-attr]
            urls[side] = url
            bodies["/query_by_hash"] = [json.dumps({"model": "m", "seq_hashes": json.loads(hashes),
                                                    "block_size": a.block_size})]
        bodies["/query"] = [json.dumps({"model": "m", "token_ids": prompt(a.prompt_tokens, k),
                                        "block_size": a.block_size}) for k in range(a.prompts)]
        run(a, urls, bodies, httpx)
    finally:
        for p in procs.values():
            p.stdin.close()  # type: ignore[union-attr]
            p.wait(30)
            p.stdout.close()  # type: ignore[union-attr]
    return 0


def run(a: argparse.Namespace, urls: dict[str, str], bodies: dict[str, list[str]], httpx: object) -> None:
    """Alternate the two servers and print the percentiles."""
    lat: dict[tuple[str, str], list[float]] = {}
    clients = {s: httpx.Client(base_url=u, timeout=30) for s, u in urls.items()}  # type: ignore[attr-defined]
    try:
        _alternate(a, clients, bodies, lat)
    finally:
        for c in clients.values():
            c.close()
    print(f"load average {os.getloadavg()[0]:.1f}; {a.rounds} rounds x {a.per_turn} queries per side; "
          f"prompt {a.prompt_tokens} tokens ({a.prompts} distinct, cycled), {a.blocks} blocks, "
          f"{a.instances} instances")
    for path in bodies:
        b, f = lat[(path, "before")], lat[(path, "after")]
        print(f"{path:15s} p50 before {statistics.median(b) * 1e3:6.2f} ms after "
              f"{statistics.median(f) * 1e3:6.2f} ms after/before "
              f"{statistics.median(f) / statistics.median(b):.2f} | "
              f"p99 before {_pct(b, 0.99) * 1e3:6.2f} after {_pct(f, 0.99) * 1e3:6.2f} | "
              f"min before {min(b) * 1e3:5.2f} after {min(f) * 1e3:5.2f}")


def _alternate(a: argparse.Namespace, clients: dict[str, object], bodies: dict[str, list[str]],
               lat: dict[tuple[str, str], list[float]]) -> None:
    hdr = {"content-type": "application/json"}
    answers = {s: c.post("/query", content=bodies["/query"][0],  # type: ignore[attr-defined]
                         headers=hdr).json() for s, c in clients.items()}
    if answers["before"] != answers["after"]:
        raise RuntimeError("the two trees answer differently")
    for r in range(a.rounds):
        for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
            for path, variants in bodies.items():
                for j in range(a.per_turn):
                    body = variants[(r * a.per_turn + j) % len(variants)]
                    t = time.perf_counter()
                    resp = clients[side].post(path, content=body, headers=hdr)  # type: ignore[attr-defined]
                    lat.setdefault((path, side), []).append(time.perf_counter() - t)
                    resp.raise_for_status()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        sys.exit(serve(*map(int, sys.argv[2:7])))
    sys.exit(main())
