"""Simulator vs live for benchmarks/multiturn.py: ``kvplane simulate`` on the run's own trace.

The L1 row's requests (send times, prompt lengths, block-chain ids of ``trace_block`` tokens) are
written as a Mooncake-format trace, and the ``kvplane simulate`` command replays it on a cluster
shaped like the live one: as many prefill instances as vLLM servers, the GPU tier = vLLM's KV
blocks per instance, the DRAM tier = the L2 row's blocks per instance, the pool = the L3 pool's
blocks, policy ``mooncake-local`` (the router's ``mooncake`` without pulls). Its "GPU only",
"GPU + CPU" and "GPU + CPU + pool" hit ratios by turn are the predictions for L1, +L2 and
+kvplane L3. Test kit, not product.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from typing import Any

from kvplane.bench import multiturn_report as report
from kvplane.bench.multiturn import MultiturnConfig, RequestRecord

PREDICTED = {"GPU only": "sim: L1", "GPU + CPU": "sim: +L2", "GPU + CPU + pool": "sim: +L3"}


def simulate_rows(cfg: MultiturnConfig, sizes: Any, results: dict[str, list[RequestRecord]],
                  out: pathlib.Path, kv_per_token: int) -> dict[str, dict[int, float]]:
    """Run ``kvplane simulate`` on the first row's trace; predicted hit rate by round per tier."""
    if not results:
        return {}
    records = next(iter(results.values()))
    trace = out / "multiturn_trace.jsonl"
    trace.write_text("\n".join(report.trace_lines(records)) + "\n")
    block_bytes = cfg.trace_block * kv_per_token
    gpu = sizes.l1_tokens // cfg.trace_block
    cpu = sizes.l2_mib * 2**20 // block_bytes
    pool = sizes.l3_mib * 2**20 // block_bytes
    sim_dir = out / "simulate"
    argv = [sys.executable, "-m", "kvplane.cli.main", "simulate", "--trace", str(trace),
            "--policy", "mooncake-local", "--prefill", str(sizes.instances), "--decode",
            str(sizes.instances), "--gpu-blocks", str(gpu), "--cpu-blocks", str(cpu),
            "--tier-pool-blocks", str(pool), "--set", f"cluster.block_tokens={cfg.trace_block}",
            "--json", "--plots", str(sim_dir), "--plot-prefix", "sim_"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=True)
    for line in proc.stdout.splitlines():
        if line.startswith("{") and "hit_ratio_by_turn" in line:
            series = json.loads(line)["hit_ratio_by_turn"]
            (out / "multiturn_simulated.json").write_text(json.dumps(
                {"argv": argv, "hit_ratio_by_turn": series}, indent=1))
            return {PREDICTED.get(k, k): {int(t): float(v) for t, v in s.items()}
                    for k, s in series.items()}
    raise RuntimeError(f"kvplane simulate printed no hit_ratio_by_turn: {proc.stdout[-2000:]}")
