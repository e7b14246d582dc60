"""kvplane's pytest plugin: the ``requires`` marker and a ``fault_plan`` fixture.

Registered through the ``pytest11`` entry point ``kvplane`` (as pytest's own ``pytester`` is a
plugin), so it loads in every pytest run where kvplane is installed; disable it with
``-p no:kvplane``. It therefore does nothing on its own: no autouse fixture, no environment
change, and the hooks act only on tests that carry ``@pytest.mark.requires(...)``. It imports
only :mod:`kvplane.testing` (the fault plan, the prerequisites table), never a kvplane component.

    @pytest.mark.requires("etcd", "redis")    # skip with the reason when missing; under CI=true, fail
    def test_x(fault_plan): ...               # a fresh FaultPlan(seed=0)
"""

from __future__ import annotations

import pytest

from kvplane.testing.faults import FaultPlan
from kvplane.testing.needs import REQUIREMENTS, requires


def pytest_configure(config: pytest.Config) -> None:
    """Declare the marker, so ``--strict-markers`` runs accept it."""
    config.addinivalue_line(
        "markers", f"requires(*names): outside dependencies ({', '.join(sorted(REQUIREMENTS))}): "
        "skip with the reason when missing, fail under CI=true (kvplane.testing.needs)")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Check a test's ``requires`` names before any fixture of it runs (a missing etcd skips the
    test instead of failing inside the fixture that would start it)."""
    for mark in item.iter_markers("requires"):
        for name in mark.args:
            requires(name)


@pytest.fixture
def fault_plan() -> FaultPlan:
    """A fresh :class:`FaultPlan` with seed 0, for the in-memory fakes (``mem_transport``,
    ``mem_rpc``, ``fake_data_socket``): the same test injects the same faults on every run."""
    return FaultPlan(seed=0)
