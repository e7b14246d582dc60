"""Smoke run of benchmarks/multiturn.py against a fake vLLM OpenAI server (the live rows are a
benchmark, recorded in docs/benchmarks.md; this only proves the script end to end, tiny)."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.support.fake_vllm import FakeVLLM

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]
BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "multiturn.py"


def load():
    spec = importlib.util.spec_from_file_location("bench_multiturn", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_multiturn_smoke_against_fake_vllm(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    with FakeVLLM(block_size=16) as fake:
        rc = load().main(["--url", fake.url, "--label", "fake", "--clients", "3", "--rounds", "3",
                          "--request-length", "40", "--output-length", "4", "--max-parallel", "2",
                          "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("| fake |")]
    assert len(lines) == 3 + 1  # three rounds in the full table, one compact row
    assert "| fake | 1 | 3 | 0 | 120 | 0 | 0.0% |" in out  # round 1: nothing cached yet
    doc = json.loads((tmp_path / "multiturn.json").read_text())
    rounds = doc["rows"]["fake"]["rounds"]
    # round 2 prompt = 40 + 4 + 40 = 84 tokens; the fake caches the 32 full-block tokens of round 1
    assert [r["prompt_tokens"] for r in rounds] == [120, 3 * 84, 3 * 128]
    assert rounds[1]["cached_tokens"] == 3 * 32 and rounds[2]["cached_tokens"] == 3 * 80
    assert all(r["ttft_p50_s"] > 0 for r in rounds)
    assert (tmp_path / "multiturn_rounds.png").stat().st_size > 10_000
    assert (tmp_path / "multiturn.csv").read_text().count("\n") == 1 + 9


def test_the_live_rows_are_found_from_any_working_directory(tmp_path):
    """The documented command, run as a user would (not from the repo root, no PYTHONPATH):
    the live rows' kit loads, and an unknown row is named (before: No module named 'tests')."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, str(BENCH), "--rows", "no-such-row", "--out",
                        str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=25)
    assert p.returncode != 0
    assert "unknown row" in p.stderr and "No module named" not in p.stderr, p.stderr[-2000:]
