"""The transfer benchmark's NIXL sides without NIXL running: repeats merged by median, the
ratios of kvplane nixl to bare NIXL per UCX variant, and one skip line when nixl_cu12 is
missing."""

from __future__ import annotations

import pytest

from kvplane.bench import transfer as tb
from kvplane.transfer import fabric

pytestmark = pytest.mark.timeout(60)


def _row(impl: str, gb_s: float, op: str = "write", size: int = 4096, batch: int = 1) -> dict:
    return {"impl": impl, "op": op, "size": size, "batch": batch, "gb_s": gb_s, "ops_s": gb_s * 1e3}


def test_median_of_repeats_keeps_the_middle_row_and_the_spread():
    runs = [[_row("nixl-raw", g)] for g in (3.0, 1.0, 5.0, 2.0, 4.0)]
    (med,) = tb.merged(runs, ("impl", "op", "size", "batch"), "median")
    assert (med["gb_s"], med["runs"], med["gb_s_min"], med["gb_s_max"]) == (3.0, 5, 1.0, 5.0)
    (best,) = tb.merged(runs, ("impl", "op", "size", "batch"), "best")
    assert best["gb_s"] == 5.0
    (low,) = tb.merged(runs[:4], ("impl", "op", "size", "batch"), "median")
    assert low["gb_s"] == 2.0  # an even count takes the lower middle


def test_nixl_ratios_pair_sides_of_the_same_ucx_variant():
    rows = [_row("memcpy", 8.0, "copy"), _row("raw-socket", 2.0, "stream"),
            _row("kvplane-nixl", 1.0), _row("nixl-raw", 4.0),
            _row("kvplane-nixl-shmtcp", 3.0), _row("nixl-raw-shmtcp", 6.0),
            _row("kvplane-tcp", 0.5)]
    out = {r["ucx_tls"]: r for r in tb.ratios(rows) if r["side"].startswith("nixl")}
    assert set(out) == {"default", "shm,tcp"}
    d, s = out["default"], out["shm,tcp"]
    assert (d["kvplane_vs_raw"], d["kvplane_vs_socket"], d["raw_vs_memcpy"]) == (0.25, 0.5, 0.5)
    assert (s["kvplane_vs_raw"], s["raw_vs_socket"]) == (0.5, 3.0)
    tcp = [r for r in tb.ratios(rows) if r["side"] == "kvplane-tcp"]
    assert len(tcp) == 1 and tcp[0]["tcp_vs_raw"] == 0.25


def test_a_missing_side_has_no_ratio_but_the_other_stays():
    out = tb.nixl_ratios([_row("nixl-raw", 4.0)])
    assert out[0]["raw_gb_s"] == 4.0 and out[0]["kvplane_vs_raw"] is None


def test_without_nixl_the_sides_skip_with_one_line_each(monkeypatch):
    monkeypatch.setattr(fabric, "nixl_package", lambda: None)
    lines: list[str] = []
    opt = tb.Options(sizes=[4096], impls=["kvplane-nixl", "nixl-raw-shmtcp"])
    assert tb.run_once(opt, lines.append) == []
    assert [ln.split(":")[0] for ln in lines] == ["skipped kvplane-nixl", "skipped nixl-raw-shmtcp"]
    assert all(fabric.INSTALL_HINT in ln for ln in lines)


def test_the_title_names_nixl_raw_only_when_it_ran():
    rows = [_row("kvplane-nixl", 1.0), _row("memcpy", 8.0, "copy")]
    assert "NIXL raw" not in tb.layout(rows)[0]
    assert "NIXL raw" in tb.layout([*rows, _row("nixl-raw", 2.0)])[0]
