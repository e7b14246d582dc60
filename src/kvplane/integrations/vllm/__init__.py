"""kvplane for vLLM: the shared-pool and prefill->decode KV connectors.

Load a connector with ``kv_connector_module_path="kvplane.integrations.vllm"`` and
``kv_connector="KVPlaneStoreConnector"`` (or ``"KVPlanePDConnector"``). The connector classes are
resolved lazily, so importing this package does not import vLLM or torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ConnectorConfig", "KVPlanePDConnector", "KVPlaneStoreConnector"]

_LAZY = {
    "ConnectorConfig": "kvplane.integrations.vllm.config",
    "KVPlaneStoreConnector": "kvplane.integrations.vllm.store_connector",
    "KVPlanePDConnector": "kvplane.integrations.vllm.pd_connector",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
