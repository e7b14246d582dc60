"""Turn `kvplane bench transfer|store --json` output into the markdown tables of docs/benchmarks.md.

    python tools/bench_md.py transfer transfer.jsonl
    python tools/bench_md.py store store.jsonl
"""

from __future__ import annotations

import json
import sys


def _f(v: float | None, d: int = 2) -> str:
    return "-" if v is None else f"{v:.{d}f}"


def _size(n: int) -> str:
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return str(n)


def transfer(rows: list[dict]) -> None:
    cells = {(r["impl"], r.get("op"), r["size"], r.get("batch")): r for r in rows if not r.get("ratio")}
    print("| op | block | batch | kvplane tcp GB/s | ops/s | / raw socket | Mooncake tcp GB/s | ops/s | "
          "kvplane / Mooncake | kvplane shm GB/s | shm / memcpy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if not r.get("ratio"):
            continue
        mc = cells.get(("mooncake-tcp", r["op"], r["size"], r["batch"]))
        print(f"| {r['op']} | {_size(r['size'])} | {r['batch']} | {_f(r['tcp_gb_s'], 3)} | "
              f"{r['tcp_ops_s']:,.0f} | {_f(r['tcp_vs_raw'])} | {_f(r['mooncake_gb_s'], 3)} | "
              f"{'-' if not mc else format(mc['ops_s'], ',.0f')} | {_f(r['tcp_vs_mooncake'])} | "
              f"{_f(r['shm_gb_s'], 3)} | {_f(r['shm_vs_memcpy'])} |")
    print()
    print("| limit | block | GB/s |")
    print("|---|---|---|")
    for r in rows:
        if r.get("impl") in ("memcpy", "raw-socket"):
            print(f"| {r['impl']} | {_size(r['size'])} | {_f(r['gb_s'], 3)} |")


def store(rows: list[dict]) -> None:
    print("| side | topology | clients | op | value | batch | obj/s | GB/s | p50 us | p99 us |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("ratio") or r["impl"] == "memcpy":
            continue
        print(f"| {r['impl']} | {r['topology']} | {r['clients']} | {r['op']} | {_size(r['size'])} | "
              f"{r['batch']} | {r['ops_s']:,.0f} | {_f(r['gb_s'], 3)} | {_f(r['p50_us'], 0)} | "
              f"{_f(r['p99_us'], 0)} |")
    print()
    print("| side | topology | clients | op | value | batch | / Mooncake | / Redis | / memcpy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("ratio"):
            print(f"| {r['side']} | {r['topology']} | {r['clients']} | {r['op']} | "
                  f"{_size(r['size'])} | {r['batch']} | {_f(r['vs_mooncake'])} | "
                  f"{_f(r['vs_redis'])} | {_f(r.get('vs_memcpy'))} |")


if __name__ == "__main__":
    kind, path = sys.argv[1], sys.argv[2]
    data = [json.loads(x) for x in open(path, encoding="utf-8") if x.startswith("{")]
    {"transfer": transfer, "store": store}[kind](data)
