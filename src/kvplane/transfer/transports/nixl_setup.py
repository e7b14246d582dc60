"""Loading NIXL for the nixl transport (and the benchmark's bare-NIXL side): the module,
the exit-crash guard, quiet logging, and agents whose progress thread waits instead of
spinning.

Split from ``kvplane.transfer.transports.nixl`` (its size budget), which re-exports
:func:`import_nixl`, :func:`avoid_exit_crash` and :func:`new_agent`.
"""

from __future__ import annotations

import ctypes.util
import importlib
import importlib.util
import logging
import os
import sys
import threading
from types import ModuleType
from typing import Any

from kvplane.common.errors import InvalidArgument

log = logging.getLogger("kvplane.transfer.transports.nixl")

INSTALL = "pip install --no-deps nixl-cu12==1.5.1 (the 'nixl' transport needs NIXL)"
_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")


def import_nixl() -> ModuleType:
    """The NIXL Python API module.

    Raises:
        InvalidArgument: NIXL is not installed (the message says how to install it).
    """
    for name in _MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None:
            continue
        if spec.origin:
            avoid_exit_crash(os.path.dirname(spec.origin))
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if not hasattr(mod, "nixl_agent"):
            try:  # the meta package re-exports the API from a submodule
                mod = importlib.import_module(f"{name}._api")
            except ImportError:
                continue
        _quiet_stdout_logging()
        return mod
    raise InvalidArgument(f"NIXL is not installed: {INSTALL}")


def avoid_exit_crash(package_dir: str) -> str:
    """Keep the NIXL wheel's UCX from loading a second libnl into the process, the cause of
    its crash at exit; returns the UCX_MODULES value set ("" when nothing was changed).

    The wheel bundles renamed copies of libibverbs, libnl-3 and libnl-route-3, and links its
    UCX modules to them, all but one: ``ucx/libuct_ib_efa.so`` (AWS EFA) still names the
    system's ``libibverbs.so.1``. Where that library is installed (rdma-core, or Debian's
    libibverbs1, which Mooncake needs), loading the EFA module brings the system's libnl-3 and
    libnl-route-3 too. At exit their destructors run against the other copy's interposed
    symbols, and the process dies in ``rtnl_tc_unregister`` during ``_dl_fini`` (SIGSEGV,
    rc 139), after all Python code ran. So, on exactly that condition, and only when the user
    has not chosen UCX's modules (``UCX_MODULES``), UCX is told not to load the EFA module
    (``UCX_MODULES=^efa``). An EFA host that needs the module sets ``UCX_MODULES`` itself (and
    then owns the exit code).
    """
    if "UCX_MODULES" in os.environ:
        return ""
    libs = os.path.join(os.path.dirname(package_dir.rstrip("/")),
                        f"{os.path.basename(package_dir.rstrip('/'))}.libs", "ucx")
    try:
        efa = [os.path.join(libs, f) for f in os.listdir(libs) if f.startswith("libuct_ib_efa.so")]
    except OSError:
        return ""
    unbundled = False
    for path in efa:
        try:
            with open(path, "rb") as f:
                unbundled = unbundled or b"\x00libibverbs.so.1\x00" in f.read()
        except OSError:
            continue
    if not unbundled or ctypes.util.find_library("ibverbs") is None:
        return ""
    os.environ["UCX_MODULES"] = "^efa"
    log.debug("UCX_MODULES=^efa: the NIXL wheel's EFA module links the system libibverbs")
    return "^efa"


def _quiet_stdout_logging() -> None:
    """NIXL's Python logger writes INFO lines to stdout, where kvplane commands print their
    one JSON ready line: send its records through the root logger (stderr) instead, at
    WARNING unless NIXL_LOG_LEVEL asks for more."""
    nl = logging.getLogger("nixl")
    for h in list(nl.handlers):
        if getattr(h, "stream", None) is sys.stdout:
            nl.removeHandler(h)
    nl.propagate = True
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nl.setLevel(logging.WARNING)


PROGRESS_ENV = "KVPLANE_NIXL_PROGRESS_US"
PROGRESS_US = 1000  # the progress thread's poll timeout (NIXL's Python API fixes it at 0)
_BUILD = threading.Lock()


def progress_delay() -> int:
    """Microseconds the agent's progress thread waits in ``poll`` between rounds: the
    environment's :data:`PROGRESS_ENV`, else :data:`PROGRESS_US` (0: NIXL's own busy loop)."""
    raw = os.environ.get(PROGRESS_ENV, "")
    try:
        return max(0, int(raw)) if raw else PROGRESS_US
    except ValueError:
        raise InvalidArgument(f"{PROGRESS_ENV}={raw!r}: give microseconds (an integer)") from None


def new_agent(nixl: ModuleType, name: str, delay_us: int | None = None) -> Any:
    """A ``nixl_agent`` with the UCX backend whose progress thread waits up to ``delay_us``
    (default :func:`progress_delay`) for UCX's event descriptor instead of spinning.

    NIXL's UCX progress thread polls its workers' event descriptors with a timeout of
    ``pthrDelay`` (rounded up to whole milliseconds), and wakes at once when one fires. The
    Python API builds its agents with ``pthrDelay = 0``, so that thread spins in ``poll``
    with no timeout and takes a whole core for as long as the agent lives, idle or not
    (measured here: 100 % of a core). The agent's configuration is only reachable while
    ``nixl_agent.__init__`` builds it, so the bindings' ``nixlAgent`` constructor is wrapped for
    the duration of this call (one at a time) to set ``pthrDelay`` first. Where the API's
    shape differs (another NIXL version), the agent is built as NIXL builds it.
    """
    delay = progress_delay() if delay_us is None else delay_us
    conf = nixl.nixl_agent_config(backends=["UCX"])
    api: Any = sys.modules.get(getattr(nixl.nixl_agent, "__module__", ""))
    bind = getattr(api, "nixlBind", None)
    if not delay or bind is None or not hasattr(bind, "nixlAgent"):
        return nixl.nixl_agent(name, conf)
    with _BUILD:
        api.nixlBind = _DelayedBind(bind, delay)
        try:
            return nixl.nixl_agent(name, conf)
        finally:
            api.nixlBind = bind


class _DelayedBind:
    """NIXL's bindings module, its ``nixlAgent`` constructor setting ``pthrDelay`` first."""

    def __init__(self, bind: ModuleType, delay_us: int) -> None:
        self._bind, self._delay = bind, delay_us

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._bind, attr)

    def nixlAgent(self, name: str, config: Any) -> Any:
        if getattr(config, "useProgThread", False):
            config.pthrDelay = self._delay
        return self._bind.nixlAgent(name, config)
