"""kvplane.bench.report and what the cores tell it: the bar's total is the number of steps a run
reports (for every mix of sides), skips are lines of their own, rows reach the sink as they are
measured, and real Mooncake is found in this very interpreter (never kvplane's import shim)."""

from __future__ import annotations

import importlib
import sys

import pytest
from rich.console import Console

from kvplane.bench import limits, report
from kvplane.bench import store as sb
from kvplane.bench import transfer as tb

pytestmark = pytest.mark.timeout(30)


class Recorder:
    """A progress callable that keeps what it was told."""

    def __init__(self) -> None:
        self.steps: list[str] = []
        self.skips: list[str] = []

    def __call__(self, line: str) -> None:
        (self.skips if report.is_skip(line) else self.steps).append(line)


def _fake_rows(**kw):
    return {"ops_s": 1.0, "gb_s": 1.0, "p50_us": 1.0, "p99_us": 1.0, "verified": True, **kw}


@pytest.fixture
def no_work(monkeypatch):
    """Every measurement returns a row at once (no process, no socket, no clock)."""
    monkeypatch.setattr(limits, "memcpy", lambda *a: {"ops_s": 1.0, "gb_s": 1.0})
    monkeypatch.setattr(limits, "raw_stream", lambda *a: {"ops_s": 1.0, "gb_s": 1.0})
    monkeypatch.setattr(limits, "round_trip", lambda *a: [1000, 2000, 3000])
    monkeypatch.setattr(tb, "_worker", lambda py, impl, proto, label, opt, **kw: [
        _fake_rows(impl=label, op="write", size=4096, batch=1)])
    monkeypatch.setattr(sb, "_measure", lambda cell, opt, mc: [
        _fake_rows(impl=cell.side, topology=cell.topology, clients=cell.clients, op="get",
                   size=4096, batch=1)])


@pytest.mark.parametrize("mooncake", [None, "/usr/bin/python3"])
@pytest.mark.parametrize("opt", [
    sb.Options(sizes=[4096, 65536], batches=[1, 32], clients=[1, 2], repeat=2,
               sides=["kvplane-tcp", "kvplane-shm", "mooncake", "redis"]),
    sb.Options(sizes=[4096], topologies=["local"], sides=["kvplane-tcp", "redis", "kvplane-tcp-ha"]),
    sb.Options(sizes=[4096], topologies=["remote"], sides=["redis", "kvplane-nixl"]),
])
def test_store_steps_count_what_a_run_reports(monkeypatch, no_work, opt, mooncake):
    monkeypatch.setattr(sb, "find_mooncake_python", lambda hint: mooncake)
    seen, sink = Recorder(), []
    rows = sb.run(opt, seen, sink)
    assert len(seen.steps) == sb.steps(opt)
    assert sb.best_of([sink], sb.KEY) == rows
    if mooncake is None and "mooncake" in opt.sides:
        assert any("skipped mooncake:" in s for s in seen.skips)


@pytest.mark.parametrize("mooncake", [None, "/usr/bin/python3"])
@pytest.mark.parametrize("impls", [["limits", "kvplane-tcp", "kvplane-shm", "mooncake-tcp"],
                                   ["kvplane-nixl", "nixl-raw-tcp", "kvplane-tcp"]])
def test_transfer_steps_count_what_a_run_reports(monkeypatch, no_work, impls, mooncake):
    monkeypatch.setattr(tb, "find_mooncake_python", lambda hint: mooncake)
    opt = tb.Options(sizes=[4096, 65536], impls=impls, repeat=3)
    seen, sink = Recorder(), []
    rows = tb.run(opt, seen, sink)
    assert len(seen.steps) == tb.steps(opt)
    assert tb.merged([sink], tb.KEY, "best") == rows


def test_steps_print_one_line_each_and_every_skip_once():
    console = Console(record=True, width=200, force_terminal=False)
    with report.Steps(3, console=console) as steps:
        for i in range(2):
            steps(tb.numbered(lambda s: s, i, 2)(report.skip("redis", "not installed")))
        steps("[1/1] kvplane-tcp remote x1")
        steps("floor 4096 x1")
    assert console.export_text().splitlines() == [
        "skipped redis: not installed", "[1/3] kvplane-tcp remote x1", "[2/3] floor 4096 x1"]
    assert steps.done == 2 and "step 2 of 3" in steps.interrupted()


@pytest.fixture
def fake_mooncake(tmp_path, monkeypatch):
    """A package named mooncake with an engine module, importable by this interpreter."""
    pkg = tmp_path / "mooncake"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "engine.py").write_text("")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    importlib.invalidate_caches()
    tb._find_mooncake.cache_clear()
    yield
    tb._find_mooncake.cache_clear()


def test_mooncake_in_this_interpreter_is_found(fake_mooncake, monkeypatch):
    monkeypatch.delenv("KVPLANE_MOONCAKE_PYTHON", raising=False)
    assert tb.find_mooncake_python(None) == sys.executable


def test_kvplanes_own_mooncake_shim_is_not_mooncake(monkeypatch):
    from kvplane.integrations import mooncake_shim

    monkeypatch.setattr(sys, "path", [mooncake_shim.PATH, *sys.path])
    importlib.invalidate_caches()
    assert importlib.util.find_spec("mooncake") is not None  # the shim is importable ...
    assert not tb._here_has_mooncake()  # ... but it is kvplane, not Mooncake


def test_mooncake_is_found_with_the_shim_already_imported(fake_mooncake, monkeypatch):
    # a suite that imported kvplane's shim earlier leaves it in sys.modules (the fresh-venv CI
    # run found /tmp/mc-venv instead of this interpreter)
    import types

    from kvplane.integrations import mooncake_shim

    shim = types.ModuleType("mooncake")
    shim.__spec__ = importlib.util.spec_from_file_location(
        "mooncake", f"{mooncake_shim.PATH}/mooncake/__init__.py",
        submodule_search_locations=[f"{mooncake_shim.PATH}/mooncake"])
    monkeypatch.setitem(sys.modules, "mooncake", shim)
    monkeypatch.delenv("KVPLANE_MOONCAKE_PYTHON", raising=False)
    assert tb.find_mooncake_python(None) == sys.executable
