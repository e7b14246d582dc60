"""The store: a distributed KV pool. A master holds metadata only; bytes move client to segment.

    from kvplane.store import StoreClient
    c = StoreClient(master="127.0.0.1:50051")
"""

from kvplane.store.client.aio import AsyncStoreClient
from kvplane.store.client.client import StoreClient
from kvplane.store.config import StoreConfig
from kvplane.store.master.config import MasterConfig
from kvplane.store.master.server import MasterServer
from kvplane.store.types import ReplicateConfig

__all__ = ["AsyncStoreClient", "MasterConfig", "MasterServer", "ReplicateConfig", "StoreClient",
           "StoreConfig"]
