"""The store: a distributed KV pool. A master holds metadata only; bytes move client to segment.

    from kvplane.store import StoreClient
    with StoreClient(master="127.0.0.1:50051") as c:
        c.put("k", b"v")

Names are imported on first use (PEP 562), so importing the client never imports the master's
HTTP stack or the KV-event publisher.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AsyncStoreClient": "kvplane.store.client.aio",
    "MasterConfig": "kvplane.store.master.config",
    "MasterServer": "kvplane.store.master.server",
    "ReplicateConfig": "kvplane.store.types",
    "StoreClient": "kvplane.store.client.client",
    "StoreConfig": "kvplane.store.config",
}
__all__ = ["AsyncStoreClient", "MasterConfig", "MasterServer", "ReplicateConfig", "StoreClient",
           "StoreConfig"]

if TYPE_CHECKING:
    from kvplane.store.client.aio import AsyncStoreClient
    from kvplane.store.client.client import StoreClient
    from kvplane.store.config import StoreConfig
    from kvplane.store.master.config import MasterConfig
    from kvplane.store.master.server import MasterServer
    from kvplane.store.types import ReplicateConfig


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvplane.store' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
