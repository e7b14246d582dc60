"""kvplane for SGLang: a HiCache L3 storage backend (``KVPlaneHiCacheStorage``).

Load it with ``--hicache-storage-backend dynamic`` and the extra config
``{"backend_name": "kvplane", "module_path": "kvplane.integrations.sglang.hicache",
"class_name": "KVPlaneHiCacheStorage", "interface_v1": true, ...}`` (docs/engines.md). The class
is resolved lazily, so importing this package imports neither SGLang nor torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["KVPlaneHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name != "KVPlaneHiCacheStorage":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module("kvplane.integrations.sglang.hicache").KVPlaneHiCacheStorage
