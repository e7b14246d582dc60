"""The dependency rules of the tree (shared STYLE §1), checked on every module's imports.

Each rule names a forbidden edge; the test parses every module under src/kvplane (imports inside
functions included) and fails on the first module that has one, naming the module and the edge.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)
SRC = pathlib.Path(__file__).resolve().parents[2] / "src"
PKG = SRC / "kvplane"

# (importer package, forbidden packages, packages exempt from the ban, why)
RULES = [
    ("kvplane.common", ("kvplane",), ("kvplane.common",), "common must not import any component"),
    ("kvplane.kvevents", ("kvplane",), ("kvplane.common", "kvplane.kvevents"),
     "kvevents is neutral: it may import only kvplane.common"),
    ("kvplane.transfer", ("kvplane.store", "kvplane.conductor", "kvplane.integrations",
                          "kvplane.p2p"), (), "transfer sits below the store and the conductor"),
    ("kvplane.store", ("kvplane.conductor", "kvplane.integrations"), (),
     "the store must not depend on the conductor or on integrations"),
    ("kvplane.p2p", ("kvplane",), ("kvplane.common", "kvplane.transfer", "kvplane.kvevents",
                                  "kvplane.p2p"),
     "p2p builds on common, transfer and kvevents only"),
    *[(f"kvplane.{pkg}", ("kvplane.p2p",), (), "only the CLI and the test kit import p2p")
      for pkg in ("store", "conductor", "collectives", "ep", "compat", "integrations", "bench",
                  "data")],
    ("kvplane", ("kvplane.cli",), (), "nothing outside the CLI imports the CLI"),
    ("kvplane", ("kvplane.integrations",), (), "nothing outside integrations imports them"),
]


def within(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


# Pure cores: no sockets, zmq, asyncio, threads or clocks.
PURE = [
    "kvplane.store.master.state", "kvplane.store.master.allocator", "kvplane.store.master.status",
    "kvplane.conductor.indexer", "kvplane.conductor.hashing",
    "kvplane.kvevents.schema", "kvplane.kvevents.codec",
    "kvplane.conductor.scheduling.kvcentric", "kvplane.conductor.scheduling.baselines",
    "kvplane.conductor.scheduling.policy", "kvplane.conductor.scheduling.view",
    "kvplane.conductor.scheduling.prefix", "kvplane.conductor.scheduling.simulator",
    "kvplane.conductor.scheduling.timemodel", "kvplane.conductor.scheduling.cache",
    "kvplane.collectives.schedule", "kvplane.ep.topology",
    "kvplane.integrations.vllm.plan", "kvplane.integrations.vllm.pd_plan",
    "kvplane.p2p.manifest", "kvplane.p2p.planner", "kvplane.p2p.tracker",
]
IMPURE = ("socket", "zmq", "asyncio", "threading", "time", "datetime", "selectors")


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: pathlib.Path) -> set[str]:
    """Every module name an import statement in ``path`` names (absolute and relative)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def violations(importer: str, imported: set[str]) -> list[str]:
    bad = []
    for scope, forbidden, exempt, why in RULES:
        if not within(importer, scope):
            continue
        for mod in sorted(imported):
            if mod == "kvplane" or any(within(mod, e) for e in exempt):
                continue
            for pkg in forbidden:
                if within(mod, pkg) and not (pkg != "kvplane" and within(importer, pkg)):
                    bad.append(f"{importer} imports {mod}: {why}")
    return bad


def test_rules_catch_a_forbidden_edge():
    """The checker itself can fail: a made-up store -> conductor edge is reported."""
    assert violations("kvplane.store.client.client", {"kvplane.conductor.service"})
    assert violations("kvplane.common.rpc", {"kvplane.transfer.engine"})
    assert violations("kvplane.kvevents.codec", {"kvplane.conductor.hashing"})
    assert violations("kvplane.store.master.state", {"kvplane.cli.main"})
    assert not violations("kvplane.store.master.server", {"kvplane.kvevents.publisher"})
    assert not violations("kvplane.kvevents.codec", {"kvplane.common.errors"})
    assert violations("kvplane.store.client.client", {"kvplane.p2p.node"})
    assert violations("kvplane.transfer.metadata_server", {"kvplane.p2p.tracker_api"})
    assert violations("kvplane.p2p.node", {"kvplane.store.client"})
    assert not violations("kvplane.cli.p2p", {"kvplane.p2p.node"})
    assert not violations("tests.support.p2p_proc", {"kvplane.p2p.node"})
    assert not violations("kvplane.p2p.node", {"kvplane.transfer.engine"})


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_respects_layering(module):
    assert violations(module, imports_of(MODULES[module])) == []


@pytest.mark.parametrize("module", PURE)
def test_pure_core_has_no_io_or_clock(module):
    assert module in MODULES, f"{module} is listed as a pure core but does not exist"
    used = {m.split(".")[0] for m in imports_of(MODULES[module])}
    assert not used & set(IMPURE), f"{module} imports {sorted(used & set(IMPURE))}"


def test_importing_the_store_client_stays_light():
    code = ("import sys, kvplane.store.client, kvplane.store.client.client\n"
            "heavy = ('fastapi', 'zmq', 'uvicorn', 'starlette', 'kvplane.conductor',"
            " 'kvplane.store.master.server', 'matplotlib', 'torch')\n"
            "print(sorted(m for m in sys.modules if m.startswith(heavy)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30, check=True).stdout.strip()
    assert out == "[]"
