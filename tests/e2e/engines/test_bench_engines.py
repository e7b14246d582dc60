"""Smoke run of benchmarks/engines.py: tiny geometry, 2 pages / 2 chunks, one repeat, every side
(real Mooncake only when its wheel is installed in the engines venv; else its rows must say why)."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

from tests.support.engines_harness import need_engines, real_mooncake_reason

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
BENCH = pathlib.Path(__file__).resolve().parents[3] / "benchmarks" / "engines.py"
ROW = r"^{}\s*\|\s+([\d.]+) \|\s+([\d.]+) \|\s+([\d.]+) \|\s+([\d.]+) \|\s+([\d.]+) \| (\S+)"


def test_bench_engines_smoke(capsys, tmp_path):
    need_engines()
    spec = importlib.util.spec_from_file_location("bench_engines", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rc = mod.main(["--geometry", "tiny", "--pages", "2", "--page", "32", "--chunks", "2",
                   "--chunk", "32", "--repeat", "1", "--out", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert rc == 0, out
    sides = ["kvplane native (dynamic, tcp)", "MooncakeStore on kvplane (tcp)",
             "kvplane native (plugin, tcp)", "mooncakestore on kvplane (default)",
             "mooncakestore on kvplane (save_chunk_meta=false)"]
    real = ["MooncakeStore on Mooncake 0.3.13.post1 (tcp)",
            "mooncakestore on Mooncake 0.3.13.post1 (default)"]
    reason = real_mooncake_reason()
    for side in sides + ([] if reason else real):
        row = re.search(ROW.format(re.escape(side)), out, re.M)
        assert row and row.group(6) == "yes", (side, out)
    if reason:
        for side in real:
            assert f"{side}" in out and "skipped: real Mooncake is not installed" in out, out
    # against native: 2 + 4 rows (1 + 2 without real Mooncake); real against kvplane: 1 + 2
    assert out.count("ratio ") == (9 if not reason else 3), out
    if not reason:
        assert re.search(r"^ratio MooncakeStore on Mooncake \S+ \(tcp\) / MooncakeStore on kvplane "
                         r"\(tcp\): store [\d.]+x, load [\d.]+x", out, re.M), out
