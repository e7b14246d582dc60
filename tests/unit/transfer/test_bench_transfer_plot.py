"""The transfer benchmark's plot: no empty panel, every series labelled, and a title that
names only the sides that ran (no "vs Mooncake" when Mooncake was skipped)."""

from __future__ import annotations

import pytest

from kvplane.bench.transfer import layout, plot
from kvplane.testing.needs import need_module

pytestmark = pytest.mark.timeout(60)


def _rows(impls: tuple[str, ...], ops: tuple[str, ...]) -> list[dict]:
    rows = []
    for size in (4096, 1 << 20):
        rows.append({"impl": "memcpy", "op": "copy", "size": size, "batch": 1, "gb_s": 9.0})
        rows.append({"impl": "raw-socket", "op": "stream", "size": size, "batch": 1, "gb_s": 3.0})
        for impl in impls:
            for op in ops:
                for batch in (1, 4):
                    rows.append({"impl": impl, "op": op, "size": size, "batch": batch,
                                 "gb_s": 1.0 + batch})
    return rows


def test_without_mooncake_the_title_does_not_name_it():
    title, panels = layout(_rows(("kvplane-tcp", "kvplane-shm"), ("write", "read")))
    assert "Mooncake" not in title and title.startswith("kvplane transfer engine")
    assert list(panels) == ["write", "read"]
    title, _ = layout(_rows(("kvplane-tcp", "mooncake-tcp"), ("write",)))
    assert "Mooncake TCP" in title


def test_only_measured_directions_get_a_panel():
    _, panels = layout(_rows(("kvplane-tcp",), ("write",)))
    assert list(panels) == ["write"]
    labels = [label for label, _, _ in panels["write"]]
    assert sorted(labels) == ["kvplane-tcp batch", "kvplane-tcp single", "memcpy", "raw-socket"]


def test_the_png_has_no_empty_panel_and_no_unlabelled_series(tmp_path):
    need_module("matplotlib", "pip install -e '.[plots]'")
    fig = plot(_rows(("kvplane-tcp", "kvplane-shm"), ("write",)), str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").stat().st_size > 1000
    assert len(fig.axes) == 1
    for ax in fig.axes:
        lines = ax.get_lines()
        assert lines, "empty panel"
        assert all(not ln.get_label().startswith("_") for ln in lines), "unlabelled series"
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert legend == [ln.get_label() for ln in lines]
    assert "Mooncake" not in fig._suptitle.get_text()
