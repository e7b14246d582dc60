"""Smoke-run benchmarks/p2p.py tiny on the netns bed: every method runs and the report prints."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from kvplane.testing.needs import missing, need_module
from tests.support.netns import available

need_module("torch", "pip install torch==2.13.0")  # the gloo broadcast column
need_module("matplotlib", "pip install 'kvplane[plots]'")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "p2p.py"


def test_bench_p2p_smoke(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    ok, why = available()
    if not ok:
        missing("the network-namespace test bed", why)
    spec = importlib.util.spec_from_file_location("bench_p2p", _PATH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    png = tmp_path / "p2p.png"
    out = mod.main(["--size", "4MiB", "--receivers", "1,2", "--mbit", "400", "--chunk-size", "1MiB",
                    "--plot", str(png)])
    got = {(r["method"], r["receivers"]) for r in out["rows"]}
    assert {("p2p", 1), ("p2p", 2), ("single", 2), ("gloo", 2), ("p2p-least-loaded", 2)} <= got
    assert all(r["seconds"] > 0 for r in out["rows"] if r["receivers"])
    assert out["ideal_s"] == pytest.approx(4 * (1 << 20) / 50e6)
    assert png.stat().st_size > 0
    text = capsys.readouterr().out
    assert "ideal (size / link rate)" in text and "single/p2p" in text and "sha256" in text
