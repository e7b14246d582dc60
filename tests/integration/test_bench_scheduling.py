"""Smoke run of benchmarks/scheduling.py on a tiny generated trace (the real run is in docs/scheduling.md)."""

import importlib.util
import json
import pathlib
import re

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "scheduling.py"


def test_bench_scheduling_smoke(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 500 * i, "input_length": 1500, "output_length": 30,
                                         "hash_ids": [0, 1 + i % 7, 100 + i, 1000 + i]}) + "\n"
                             for i in range(80)))
    spec = importlib.util.spec_from_file_location("bench_scheduling", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--trace", str(trace), "--policy", "mooncake", "random"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^mooncake: 80 requests in [\d.]+s .* target < 60s: met$", out, re.M), out
    assert json.loads(out.strip().splitlines()[-1])[1]["policy"] == "random"
