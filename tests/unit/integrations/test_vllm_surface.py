"""The vLLM integration's public surface, and the rule that nothing in kvplane imports it."""

from __future__ import annotations

import pathlib
import re
import sys

import pytest

import kvplane.integrations.vllm as integ

pytestmark = pytest.mark.timeout(10)
SRC = pathlib.Path(integ.__file__).resolve().parents[2]


def test_exported_members_are_pinned_and_resolve_lazily():
    assert sorted(integ.__all__) == ["ConnectorConfig", "KVPlanePDConnector", "KVPlaneStoreConnector"]
    assert integ.ConnectorConfig().protocol == "auto"
    assert "vllm" not in sys.modules  # the package resolves connector classes only on demand
    with pytest.raises(AttributeError):
        integ.Nope  # noqa: B018


def test_no_other_kvplane_module_imports_the_integrations():
    pattern = re.compile(r"^\s*(from|import)\s+kvplane\.integrations", re.M)
    offenders = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                 if "integrations" not in p.relative_to(SRC).parts and pattern.search(p.read_text())]
    assert offenders == []


def test_shim_reexports_the_compat_facades():
    from kvplane.compat import mooncake as compat
    from kvplane.integrations.mooncake_shim.mooncake import engine, store

    assert engine.TransferEngine is compat.TransferEngine
    assert issubclass(store.MooncakeDistributedStore, compat.MooncakeDistributedStore)
    assert store.ReplicateConfig is compat.ReplicateConfig
