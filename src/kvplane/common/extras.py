"""Optional dependencies: import them by need, and say which pip extra brings a missing one.

    plt = pyplot()                     # matplotlib with the Agg backend, or MissingExtra
    redis = require("redis", "redis")  # -> pip install 'kvplane[redis]'

Must not import any kvplane component.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from kvplane.common.errors import MissingExtra


def require(module: str, extra: str, purpose: str = "") -> ModuleType:
    """Import ``module`` or raise MissingExtra naming ``pip install 'kvplane[extra]'``.

    Raises:
        MissingExtra: the module (or one it needs) is not installed.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        why = f" for {purpose}" if purpose else ""
        raise MissingExtra(f"{module.split('.')[0]} is needed{why}: "
                           f"pip install 'kvplane[{extra}]'") from exc


def pyplot() -> Any:
    """matplotlib.pyplot on the non-interactive Agg backend (extra ``plots``)."""
    matplotlib = require("matplotlib", "plots", "plots")
    matplotlib.use("Agg")
    return require("matplotlib.pyplot", "plots", "plots")
