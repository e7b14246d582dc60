"""Smoke-run benchmarks/collectives.py with tiny sizes: it must run both backends and the kill test."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from kvplane.testing.needs import need_module

need_module("torch", "pip install torch==2.13.0")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "collectives.py"


def test_bench_collectives_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("bench_collectives", _PATH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.main(["--sizes", "4KiB,2MiB", "--ranks", "2", "--iters", "2", "--warmup", "1",
                    "--recovery-size", "4KiB", "--recovery-timeout", "2", "--rounds", "1"])
    small, big = out["allreduce"]  # 2 MiB goes through /dev/shm by default, 4 KiB over the ring
    assert (small["ranks"], small["bytes"], big["bytes"]) == (2, 4096, 2 << 20)
    for row in (small, big):
        assert min(row["gloo_s"], row["kvplane_s"], row["kvplane_ring_s"], row["kvplane_ring_noexact_s"]) > 0
    rec = out["recovery"]
    # kvplane completes the next op over the survivors; gloo must time out and rebuild
    assert 0 < rec["kvplane_s"] < 1.0
    assert rec["gloo_rebuild_s"] > rec["kvplane_s"]
    assert "ring/gloo" in capsys.readouterr().out
