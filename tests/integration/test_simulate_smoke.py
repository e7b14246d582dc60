"""Smoke test of ``kvplane simulate``: a small trace through every policy, JSON rows and PNG plots."""

import json
import random
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvplane.cli import simulate
from kvplane.data import SAMPLE_TRACE

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def _app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        """Test root."""

    simulate.register(app)
    return app


def _trace(path: Path, n: int = 150, seed: int = 11) -> Path:
    """A multi-turn trace in the Mooncake format: sessions grow their prefix, all share block 0."""
    rng = random.Random(seed)
    sessions: list[list[int]] = []
    next_id, lines = 1, []
    for i in range(n):
        if not sessions or rng.random() < 0.4:
            sessions.append([0])
        s = rng.choice(sessions)
        grow = rng.randint(1, 6)
        s.extend(range(next_id, next_id + grow))
        next_id += grow
        n_tokens = 512 * (len(s) - 1) + rng.randint(1, 512)
        lines.append(json.dumps({"timestamp": 400 * i, "input_length": n_tokens,
                                 "output_length": rng.randint(1, 300), "hash_ids": list(s)}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_simulate_json_and_plots(tmp_path):
    trace = _trace(tmp_path / "t.jsonl")
    plots = tmp_path / "plots"
    res = CliRunner().invoke(_app(), ["simulate", "--trace", str(trace), "--json", "--loads", "1,2",
                                      "--prefill", "3", "--decode", "2", "--plots", str(plots)])
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in res.stdout.splitlines() if x.strip()]
    by_policy = {r["policy"]: r for r in rows if "policy" in r and "requests" in r}
    assert set(by_policy) == set(simulate.DEFAULT_POLICIES.split(","))
    for r in by_policy.values():
        for key in ("requests", "ttft_mean_s", "ttft_p90_s", "tbt_mean_s", "slo_attainment",
                    "rejected", "hit_ratio", "capacity"):
            assert key in r
        assert r["requests"] == 150 and len(r["by_load"]) == 2
    assert any("hit_ratio_by_turn" in r for r in rows)
    for name in ("ttft_cdf.png", "capacity.png", "hit_by_turn.png"):
        assert (plots / name).stat().st_size > 1000


def test_simulate_table_on_a_slice_of_the_real_trace(tmp_path):
    trace = tmp_path / "slice.jsonl"
    with open(SAMPLE_TRACE, encoding="utf-8") as f:
        trace.write_text("".join(next(f) for _ in range(400)))
    res = CliRunner().invoke(_app(), ["simulate", "--trace", str(trace), "--policy",
                                      "least-loaded,mooncake", "--plots", "", "--no-tiers"])
    assert res.exit_code == 0, res.output
    assert "mooncake" in res.stdout and "least-loaded" in res.stdout


def test_simulate_rejects_bad_input(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    res = CliRunner().invoke(_app(), ["simulate", "--trace", str(bad), "--plots", ""])
    assert res.exit_code != 0
    res = CliRunner().invoke(_app(), ["simulate", "--trace", str(bad), "--policy", "nope"])
    assert res.exit_code != 0 and "round-robin" in res.output
