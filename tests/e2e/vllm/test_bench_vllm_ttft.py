"""Smoke run of benchmarks/vllm_ttft.py: tiny model, short prompt, kvplane only (one engine)."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest
from vllm_harness import requires_vllm

pytestmark = [pytest.mark.e2e, requires_vllm, pytest.mark.timeout(240)]
BENCH = pathlib.Path(__file__).resolve().parents[3] / "benchmarks" / "vllm_ttft.py"


def test_bench_vllm_ttft_smoke(capsys):
    spec = importlib.util.spec_from_file_location("bench_vllm_ttft", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rc = mod.main(["--model", "tiny", "--prompt-tokens", "200", "--repeats", "1", "--no-mooncake"])
    out = capsys.readouterr().out
    assert rc == 0, out
    row = re.search(r"^KVPlaneStoreConnector \(auto\)\s+\|\s+([\d.]+) \|\s+([\d.]+) \|\s+(\d+) \|", out, re.M)
    assert row, out
    assert int(row.group(3)) == 192  # every loadable token came from kvplane
    assert "mooncake: skipped" in out
