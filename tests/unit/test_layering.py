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
    "kvplane.integrations.vllm.offload_plan",
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


# -- transfer: the engine knows transports only through the seam (issue 29) --------------------
ENGINE_MODULES = sorted(m for m in MODULES if m.rsplit(".", 1)[-1].startswith("engine")
                        and within(m, "kvplane.transfer"))


def transport_imports(importer: str, imported: set[str]) -> list[str]:
    """The imports of ``importer`` (a ``kvplane.transfer.engine*`` module) that reach a
    transport module: the engine must go through ``kvplane.transfer.seam`` and
    ``kvplane.transfer.plugins``, so a new transport needs no engine change."""
    if not (within(importer, "kvplane.transfer")
            and importer.rsplit(".", 1)[-1].startswith("engine")):
        return []
    return [f"{importer} imports {mod}: the engine must not import a transport module"
            for mod in sorted(imported) if within(mod, "kvplane.transfer.transports")]


def test_engine_transport_rule_catches_a_forbidden_edge():
    """The rule itself can fail: made-up engine -> transport edges are reported."""
    assert transport_imports("kvplane.transfer.engine", {"kvplane.transfer.transports.tcp"})
    assert transport_imports("kvplane.transfer.engine_items",
                             {"kvplane.transfer.transports.tcp.TcpTransport"})
    assert transport_imports("kvplane.transfer.engine_route", {"kvplane.transfer.transports"})
    assert not transport_imports("kvplane.transfer.engine", {"kvplane.transfer.seam"})
    assert not transport_imports("kvplane.transfer.plugins", {"kvplane.transfer.transports.tcp"})
    assert "kvplane.transfer.engine" in ENGINE_MODULES and len(ENGINE_MODULES) >= 3


@pytest.mark.parametrize("module", ENGINE_MODULES)
def test_engine_imports_no_transport_module(module):
    assert transport_imports(module, imports_of(MODULES[module])) == []


def transport_names(source: str) -> list[str]:
    """The registry names of built-in transports that ``source`` spells as string constants
    (docstrings aside)."""
    names = {"tcp", "shm", "file", "local"}
    tree = ast.parse(source)
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)}
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and id(n) not in docs and n.value in names]


def test_transport_name_rule_catches_a_named_transport():
    """The rule itself can fail: code that picks a transport by name is reported."""
    assert transport_names('def f(ts):\n    """Uses tcp."""\n    return ts["tcp"]\n') == ["tcp"]
    assert transport_names('def f():\n    """tcp"""\n    return 1\n') == []


@pytest.mark.parametrize("module", ENGINE_MODULES)
def test_engine_names_no_transport(module):
    """No registry name of a built-in transport appears as a string in the engine's code:
    choices go by capability and the transports' own preferences, not by name."""
    found = transport_names(MODULES[module].read_text(encoding="utf-8"))
    assert found == [], f"{module} names transports {found}"


# -- the store master's layers (issue 29) ------------------------------------------------------
# Lowest first. A module of kvplane.store.master may import master modules of its own layer or
# of layers below it, never one above: the object table knows no service, a service knows no
# state, the state knows no RPC module, and nothing but the server knows the server.
MASTER = "kvplane.store.master"
MASTER_LAYERS = [
    ("primitives", ("config", "allocator", "fences")),
    ("policies", ("eviction",)),
    ("storage", ("keys", "columns", "rows")),
    ("table", ("table",)),
    ("services", ("adopt", "repair", "tiers", "tasks", "spares", "grants")),
    ("state", ("state",)),
    ("serving", ("serving", "access", "status", "pool_events", "dashboard", "ha")),
    ("front ends", ("replica_rpc", "tier_rpc", "admin")),
    ("server", ("server",)),
]
MASTER_LAYER = {f"{MASTER}.{mod}": (rank, name)
                for rank, (name, mods) in enumerate(MASTER_LAYERS) for mod in mods}
# pure master modules (no sockets, threads or clocks), beside the PURE list above
MASTER_PURE = ["config", "allocator", "fences", "eviction", "keys", "columns", "rows", "table", "adopt",
               "repair", "tiers", "tasks", "spares", "state", "serving"]


def master_up_imports(importer: str, imported: set[str]) -> list[str]:
    """The imports of ``importer`` that reach a higher master layer than its own."""
    if importer not in MASTER_LAYER:
        return []
    rank, layer = MASTER_LAYER[importer]
    return [f"{importer} ({layer}) imports {mod} ({MASTER_LAYER[mod][1]}): imports go down "
            "the master's layers only" for mod in sorted(imported)
            if mod in MASTER_LAYER and MASTER_LAYER[mod][0] > rank]


def test_master_layer_rule_can_fail():
    """Made-up upward edges are reported; downward and same-layer ones are not."""
    assert master_up_imports(f"{MASTER}.table", {f"{MASTER}.state"})
    assert master_up_imports(f"{MASTER}.table", {f"{MASTER}.repair"})
    assert master_up_imports(f"{MASTER}.repair", {f"{MASTER}.server", "kvplane.store.types"})
    assert master_up_imports(f"{MASTER}.state", {f"{MASTER}.tier_rpc"})
    assert master_up_imports(f"{MASTER}.tier_rpc", {f"{MASTER}.server"})
    assert not master_up_imports(f"{MASTER}.server", {f"{MASTER}.table", f"{MASTER}.tier_rpc"})
    assert not master_up_imports(f"{MASTER}.tiers", {f"{MASTER}.adopt", f"{MASTER}.eviction"})
    assert not master_up_imports("kvplane.store.client.client", {f"{MASTER}.server"})


def test_every_master_module_has_a_layer():
    """A new master module must be placed in MASTER_LAYERS (so the rule sees it)."""
    found = {m for m in MODULES if within(m, MASTER) and m != MASTER}
    assert found == set(MASTER_LAYER), (sorted(found - set(MASTER_LAYER)),
                                        sorted(set(MASTER_LAYER) - found))


@pytest.mark.parametrize("module", sorted(MASTER_LAYER))
def test_master_module_imports_no_higher_layer(module):
    assert master_up_imports(module, imports_of(MODULES[module])) == []


@pytest.mark.parametrize("module", MASTER_PURE)
def test_master_pure_module_has_no_io_or_clock(module):
    used = {m.split(".")[0] for m in imports_of(MODULES[f"{MASTER}.{module}"])}
    assert not used & set(IMPURE), f"{module} imports {sorted(used & set(IMPURE))}"


# -- the store client's layers (kvplane.store.client.LAYERS) ----------------------------------
def client_layer_of() -> dict[str, int]:
    from kvplane.store.client import LAYERS
    return {mod: rank for rank, group in enumerate(LAYERS) for mod in group}


def client_layer_violations(importer: str, imported: set[str],
                            rank: dict[str, int]) -> list[str]:
    """The imports of ``importer`` (a module of the store client or the host package) that are
    not of an earlier layer: a module may import only modules of the groups before its own."""
    if importer not in rank:
        return [f"{importer} is in no layer of kvplane.store.client.LAYERS"]
    bad = []
    for mod in sorted(imported):
        if mod in ("kvplane.store.client", "kvplane.store.host"):  # the packages themselves
            continue
        if mod in rank and rank[mod] >= rank[importer]:
            bad.append(f"{importer} imports {mod}, which is not below it in LAYERS")
    return bad


CLIENT_MODULES = sorted(m for m in MODULES if m.startswith(("kvplane.store.client.",
                                                            "kvplane.store.host")))


@pytest.mark.parametrize("module", CLIENT_MODULES)
def test_store_client_layers_import_only_downward(module):
    assert client_layer_violations(module, imports_of(MODULES[module]), client_layer_of()) == []


def test_store_client_layer_rule_can_fail():
    """The rule reports a made-up edge back up, a sibling edge and an unlisted module, and every
    layer it lists exists."""
    rank = client_layer_of()
    assert set(rank) <= set(MODULES), sorted(set(rank) - set(MODULES))
    assert client_layer_violations("kvplane.store.client.replica_io",
                                   {"kvplane.store.client.get_path"}, rank)
    assert client_layer_violations("kvplane.store.host.repairs",
                                   {"kvplane.store.client.client"}, rank)
    assert client_layer_violations("kvplane.store.client.get_path",
                                   {"kvplane.store.client.put_path"}, rank)
    assert client_layer_violations("kvplane.store.client.made_up", set(), rank)
    assert not client_layer_violations("kvplane.store.client.client",
                                       {"kvplane.store.client.get_path",
                                        "kvplane.store.host.disk_node"}, rank)


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
