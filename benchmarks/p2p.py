"""Benchmark: distribute one payload to 1, 2, 4, 8 receivers on the multi-host netns bed.

Every host (the publisher and each receiver) is a network namespace whose link is capped with
tc tbf at ``--mbit`` both ways, as a NIC would be; the tracker runs in the root namespace on
the bridge. Side by side, in one run, for each receiver count:

* ``p2p``: kvplane P2P (rarest-first): receivers fetch from every holder and serve at once;
* ``single``: the same code, but every receiver fetches from the publisher alone;
* ``gloo``: ``torch.distributed.broadcast`` over gloo from the publisher's host;
* at the largest count also ``p2p-least-loaded`` (the other holder choice).

It prints each time, the ideal (size / link rate), the ratios, the CPU the whole box used
during each run (to show the link, not the CPU, was the bottleneck), and chunk-hash speeds.

Usage (root; about 15 minutes for 1 GiB at 400 Mbit on 2 cores)::

    python benchmarks/p2p.py --size 1GiB --mbit 400 --plot docs/bench_p2p.png
    python benchmarks/p2p.py --size 8MiB --receivers 1,2 --mbit 200      # smoke

``--json PATH`` writes the raw numbers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import sys
import time
from typing import Any

from kvplane.common.config import parse_size
from kvplane.common.procs import Proc, wait_for_line
from tests.support.netns import Host, NetBed

TOKEN = secrets.token_hex(8)
NODE = [sys.executable, "-m", "tests.support.p2p_proc"]


# -- gloo ranks (run inside the hosts: ``p2p.py gloo-rank ...``) ----------------------------
def gloo_rank(rank: int, world: int, master: str, size: int) -> None:
    """One broadcast rank: time barrier -> broadcast -> barrier; print JSON."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=900))
    t = torch.empty(size, dtype=torch.uint8)
    if rank == 0:
        t.copy_(torch.arange(size, dtype=torch.int64).remainder_(251).to(torch.uint8))
    dist.barrier()
    t0 = time.perf_counter()
    dist.broadcast(t, 0)
    dist.barrier()
    secs = time.perf_counter() - t0
    sha = hashlib.sha256(t.numpy()).hexdigest()
    print(json.dumps({"rank": rank, "seconds": secs, "sha": sha}), flush=True)
    dist.destroy_process_group()


# -- measurement helpers --------------------------------------------------------------------
def cpu_sample() -> tuple[float, float]:
    with open("/proc/stat", encoding="ascii") as f:
        vals = [float(x) for x in f.readline().split()[1:]]
    idle = vals[3] + vals[4]
    return sum(vals) - idle, sum(vals)


def cores_busy(a: tuple[float, float], b: tuple[float, float]) -> float:
    total = b[1] - a[1]
    return (b[0] - a[0]) / total * (os.cpu_count() or 1) if total > 0 else 0.0


def proc_cpu(pids: list[int]) -> float:
    """CPU seconds (user + system) used so far by ``pids`` and by this process (the tracker)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = sum(os.times()[:2])
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


def hash_speeds() -> dict[str, float]:
    """GB/s of candidate chunk hashes on one 4 MiB chunk (xxh3 only if xxhash is installed)."""
    buf = os.urandom(4 << 20)
    fns = {"sha256": lambda b: hashlib.sha256(b).digest(),
           "blake2b": lambda b: hashlib.blake2b(b, digest_size=16).digest()}
    try:
        import xxhash  # type: ignore[import-not-found]

        fns["xxh3_128"] = xxhash.xxh3_128_digest
    except ImportError:
        pass
    out = {}
    for name, fn in fns.items():
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < 0.3:
            fn(buf)
            n += 1
        out[name] = n * len(buf) / (time.perf_counter() - t0) / 1e9
    return out


def ask_all(procs: list[Proc], cmd: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    for p in procs:
        assert p.popen.stdin is not None
        p.popen.stdin.write(json.dumps(cmd) + "\n")
        p.popen.stdin.flush()
    return [json.loads(wait_for_line(p.popen.stdout, timeout)) for p in procs]  # type: ignore[arg-type]


# -- the three methods ----------------------------------------------------------------------
def node(host: Host, url: str, a: argparse.Namespace) -> Proc:
    return host.spawn(NODE + ["--tracker", url, "--token", TOKEN, "--host", host.ip,
                              "--protocol", "tcp", "--chunk-size", str(a.chunk_size),
                              "--parallel", str(a.parallel), "--chunk-timeout", "60"])


def run_swarm(bed: NetBed, url: str, n: int, strategy: str, sha: str,
              a: argparse.Namespace, pub: Proc) -> dict[str, Any]:
    from kvplane.p2p import TrackerClient

    procs = [node(bed[f"r{i}"], url, a) for i in range(1, n + 1)]
    pids = [p.pid for p in procs + [pub]]
    tracker = TrackerClient(url, TOKEN)
    st0 = tracker.status("payload")
    try:
        c0, own0, t0 = cpu_sample(), proc_cpu(pids), time.perf_counter()
        outs = ask_all(procs, {"op": "get", "name": "payload", "timeout": a.timeout,
                               "strategy": strategy}, a.timeout + 30)
        secs, c1, own1 = time.perf_counter() - t0, cpu_sample(), proc_cpu(pids)
        st1 = tracker.status("payload")
    finally:
        tracker.close()
        for p in procs:
            p.stop()
    gold = st1["gold"]
    sent = st1["served"].get(gold, 0) - st0["served"].get(gold, 0)
    bad = [o for o in outs if o.get("sha") != sha]
    if bad:
        raise RuntimeError(f"{strategy}: wrong or failed receivers: {bad[:2]}")
    return {"seconds": secs, "cpu_cores": cores_busy(c0, c1), "own_cores": (own1 - own0) / secs,
            "publisher_sent": sent / len(st1["holders_per_chunk"])}


def run_gloo(bed: NetBed, n: int, sha: str, a: argparse.Namespace) -> dict[str, Any]:
    master = f"{bed['pub'].ip}:{20000 + secrets.randbelow(20000)}"
    hosts = [bed["pub"]] + [bed[f"r{i}"] for i in range(1, n + 1)]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
    c0 = cpu_sample()
    procs = [h.popen([sys.executable, os.path.abspath(__file__), "gloo-rank", str(r), str(n + 1),
                      master, str(a.size)], stdout=-1, stderr=-1, text=True, env=env)
             for r, h in enumerate(hosts)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=a.timeout + 60)
        if p.returncode != 0:
            raise RuntimeError(f"gloo rank failed: {err[-1500:]}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    c1 = cpu_sample()
    if len({o["sha"] for o in outs}) != 1:
        raise RuntimeError("gloo ranks disagree on the bytes")
    return {"seconds": max(o["seconds"] for o in outs), "cpu_cores": cores_busy(c0, c1)}


# -- driver -------------------------------------------------------------------------------
def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("1GiB"))
    ap.add_argument("--receivers", default="1,2,4,8")
    ap.add_argument("--mbit", type=float, default=400.0, help="link cap of every host, Mbit/s")
    ap.add_argument("--mtu", type=int, default=9000, help="link MTU (9000: jumbo frames)")
    ap.add_argument("--chunk-size", type=parse_size, default=parse_size("4MiB"))
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--methods", default="p2p,single,gloo")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    a = ap.parse_args(argv)
    a.counts = [int(x) for x in a.receivers.split(",")]
    a.method_list = a.methods.split(",")
    return a


def measure(a: argparse.Namespace) -> list[dict[str, Any]]:
    from kvplane.p2p.tracker_api import mount
    from kvplane.transfer.metadata_server import serve_in_thread

    rows: list[dict[str, Any]] = []
    c0 = cpu_sample()
    time.sleep(1.0)  # the box's load before we start (other tenants), to subtract by eye
    base = cores_busy(c0, cpu_sample())
    print(f"  box CPU busy before the runs: {base:.2f} of {os.cpu_count()} cores", flush=True)
    rows.append({"method": "baseline-cpu", "receivers": 0, "seconds": 0.0, "cpu_cores": base})
    with NetBed(["pub"] + [f"r{i}" for i in range(1, max(a.counts) + 1)], mtu=a.mtu) as bed:
        for h in bed:
            bed.cap(h.name, a.mbit)
        srv = serve_in_thread(bed.gateway, 0, TOKEN, plugins=[mount])
        url = srv.url
        pub = node(bed["pub"], url, a)
        try:
            sha = pub.ask(json.dumps({"op": "publish", "name": "payload", "size": a.size,
                                      "seed": 1}), timeout=600)["sha"]
            for n in a.counts:
                cells = [(m, m) for m in a.method_list]
                if n == max(a.counts) and "p2p" in a.method_list:
                    cells.append(("p2p-least-loaded", "least-loaded"))
                for label, how in cells:
                    if how == "gloo":
                        res = run_gloo(bed, n, sha, a)
                    else:
                        strategy = {"p2p": "rarest", "single": "publisher"}.get(how, how)
                        res = run_swarm(bed, url, n, strategy, sha, a, pub)
                    rows.append({"method": label, "receivers": n, **res})
                    own = (f", our processes {res['own_cores']:.2f}; publisher sent "
                           f"{res['publisher_sent']:.2f}x the payload") if "own_cores" in res else ""
                    print(f"  {label:>17} x{n}: {res['seconds']:.2f} s  (CPU cores busy: whole box "
                          f"{res['cpu_cores']:.2f}{own})", flush=True)
        finally:
            pub.stop()
            srv.close()
    return rows


def report(rows: list[dict[str, Any]], a: argparse.Namespace) -> dict[str, Any]:
    ideal = a.size / (a.mbit * 1e6 / 8)
    t = {(r["method"], r["receivers"]): r["seconds"] for r in rows}
    print(f"\npayload {a.size / (1 << 20):.0f} MiB, every link {a.mbit:g} Mbit/s, "
          f"ideal (size / link rate) {ideal:.2f} s")
    print(f"{'recv':>4} {'p2p s':>8} {'single s':>9} {'gloo s':>8} {'p2p/ideal':>10} "
          f"{'single/p2p':>11} {'gloo/p2p':>9}")
    for n in a.counts:
        p, s, g = t.get(("p2p", n)), t.get(("single", n)), t.get(("gloo", n))
        f = lambda x: f"{x:.2f}" if x else "-"  # noqa: E731
        print(f"{n:>4} {f(p):>8} {f(s):>9} {f(g):>8} {f(p and p / ideal):>10} "
              f"{f(p and s and s / p):>11} {f(p and g and g / p):>9}")
    lo, hi = min(a.counts), max(a.counts)
    growth = {m: t[(m, hi)] / t[(m, lo)] for m in ("p2p", "single", "gloo")
              if (m, hi) in t and (m, lo) in t}
    for m, gr in growth.items():
        print(f"{m}: time({hi} receivers) / time({lo}) = {gr:.2f}")
    if ("p2p-least-loaded", hi) in t and ("p2p", hi) in t:
        print(f"holder choice at {hi} receivers: rarest {t[('p2p', hi)]:.2f} s, "
              f"least-loaded {t[('p2p-least-loaded', hi)]:.2f} s")
    hs = hash_speeds()
    print("chunk hash speed (GB/s, one core): " + ", ".join(f"{k} {v:.2f}" for k, v in hs.items()))
    return {"size": a.size, "mbit": a.mbit, "ideal_s": ideal, "rows": rows, "growth": growth,
            "hash_gbps": hs}


def plot(out: dict[str, Any], path: str) -> None:
    from kvplane.common.extras import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in ("p2p", "single", "gloo"):
        pts = sorted((r["receivers"], r["seconds"]) for r in out["rows"] if r["method"] == m)
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o",
                    label={"p2p": "kvplane P2P", "single": "all from publisher",
                           "gloo": "torch.distributed broadcast (gloo)"}[m])
    ax.axhline(out["ideal_s"], color="grey", ls="--", label="ideal: size / link rate")
    ax.set_xlabel("receivers")
    ax.set_ylabel("seconds until every receiver has the payload")
    ax.set_title(f"{out['size'] / (1 << 20):.0f} MiB, every host's link capped at {out['mbit']:g} Mbit/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "gloo-rank":
        gloo_rank(int(argv[1]), int(argv[2]), argv[3], int(argv[4]))
        return {}
    a = parse(argv)
    rows = measure(a)
    out = report(rows, a)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    if a.plot:
        plot(out, a.plot)
    return out


if __name__ == "__main__":
    main()
