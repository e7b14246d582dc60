"""kvplane for LMCache: a remote connector (``KVPlaneConnector``) and its URL adapter.

Register it with ``remote_storage_plugins: ["kvplane"]`` and the extra config keys
``remote_storage_plugin.kvplane.module_path: kvplane.integrations.lmcache``,
``remote_storage_plugin.kvplane.class_name: KVPlaneConnectorAdapter`` and
``remote_storage_plugin.kvplane.url: kvplane://HOST:PORT`` (docs/engines.md). The classes are
resolved lazily, so importing this package imports neither LMCache nor torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["KVPlaneConnector", "KVPlaneConnectorAdapter"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module("kvplane.integrations.lmcache.connector"), name)
