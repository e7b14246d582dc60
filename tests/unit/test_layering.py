"""The dependency rules of the tree (RULES below), checked on every module's imports.

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


# -- the test kit (issue 29): the product never imports it, it never imports the test tree ------
KIT = "kvplane.testing"
# loaded only by pytest (the pytest11 entry point), so it may import pytest at module level
PYTEST_AT_TOP = {"kvplane.testing.plugin"}


def kit_violations(importer: str, imported: set[str]) -> list[str]:
    """Edges that break the kit's rules: product -> kit, kit -> tests."""
    bad = [f"{importer} imports {m}: the product imports nothing from the test kit"
           for m in sorted(imported) if within(m, KIT) and not within(importer, KIT)]
    bad += [f"{importer} imports {m}: the test kit must not import the test tree"
            for m in sorted(imported) if within(importer, KIT) and within(m, "tests")]
    return bad


def top_level_imports(path: pathlib.Path) -> set[str]:
    """Modules imported by the module's own statements (not inside a function or class)."""
    out: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_kit_rules_catch_a_forbidden_edge():
    """The kit checker can fail: product -> kit and kit -> tests are reported, kit -> kit is not."""
    assert kit_violations("kvplane.bench.store", {"kvplane.testing.faults"})
    assert kit_violations("kvplane.testing.mem_rpc", {"tests.support.services"})
    assert not kit_violations("kvplane.testing.mem_rpc", {"kvplane.testing.faults"})
    assert not kit_violations("kvplane.bench.store", {"kvplane.bench.services"})


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_respects_the_kit_boundary(module):
    assert kit_violations(module, imports_of(MODULES[module])) == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_shipped_module_imports_pytest_at_import_time(module):
    """pytest is not a runtime dependency: only the plugin (loaded by pytest) imports it eagerly."""
    if module in PYTEST_AT_TOP:
        return
    assert not {m for m in top_level_imports(MODULES[module]) if within(m, "pytest")}


# -- private names (issue 29): no module imports another module's ``_private`` names -----------
def private_owner(dotted: str) -> str | None:
    """The module or package a private name in ``dotted`` belongs to (None: nothing private).

    ``a.b._c`` (or ``a.b._c.d``) is private to ``a.b``: ``a.b`` itself and, when ``a.b`` is a
    package, the modules inside it may use it; every other importer reaches into a private part.
    Dunders (``__version__``) are public.
    """
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def private_imports(path: pathlib.Path, name: str | None = None) -> list[str]:
    """The private kvplane names ``path`` (the module ``name``, default: its name in the tree)
    imports from outside their owner, inside functions too, as ``"module imports name"`` lines."""
    name = name or module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    bad = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for dotted in names:
            owner = private_owner(dotted)
            if owner is not None and within(dotted, "kvplane") and not within(name, owner):
                bad.append(f"{name} imports {dotted} (private to {owner})")
    return bad


def test_private_name_check_can_fail(tmp_path):
    """A made-up module that reaches into another's private names is reported, by every
    spelling; a package's own modules may use its private submodule (``conductor._accel``)."""
    src = ("from kvplane.compat.mooncake_tensor import _helper\n"
           "import kvplane.store._hidden\n"
           "def f():\n    from kvplane.transfer.engine import _inner\n"
           "from . import _accel\nfrom kvplane.common import __name__ as n\n")
    path = tmp_path / "made_up_for_the_check.py"
    path.write_text(src)
    bad = sorted(private_imports(path, "kvplane.conductor.made_up_for_the_check"))
    assert bad == ["kvplane.conductor.made_up_for_the_check imports "
                   "kvplane.compat.mooncake_tensor._helper (private to kvplane.compat.mooncake_tensor)",
                   "kvplane.conductor.made_up_for_the_check imports kvplane.store._hidden "
                   "(private to kvplane.store)",
                   "kvplane.conductor.made_up_for_the_check imports kvplane.transfer.engine._inner "
                   "(private to kvplane.transfer.engine)"], bad


# cases other engineers' branches remove (the lead deletes each entry after merging)
EXPECTED_PRIVATE: set[str] = set()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_another_modules_private_names(module):
    bad = [b for b in private_imports(MODULES[module]) if b not in EXPECTED_PRIVATE]
    assert bad == []
