"""AsyncStoreClient: asyncio facade over the blocking StoreClient (runs calls in threads)."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from kvplane.store.client.client import StoreClient

_METHODS = ("put", "get", "put_batch", "get_batch", "put_from", "get_into", "batch_put_from",
            "batch_get_into", "exists", "batch_exists", "remove", "batch_remove",
            "remove_by_regex", "remove_all", "get_size", "upsert", "upsert_from", "health_check",
            "list_keys")


class AsyncStoreClient:
    """``await client.get(key)`` etc.; the same methods as StoreClient."""

    def __init__(self, client: StoreClient) -> None:
        self.sync = client

    def __getattr__(self, name: str) -> Any:
        if name not in _METHODS:
            raise AttributeError(name)
        fn = getattr(self.sync, name)

        @functools.wraps(fn)
        async def call(*args: Any, **kw: Any) -> Any:
            return await asyncio.to_thread(fn, *args, **kw)
        return call

    async def close(self) -> None:
        await asyncio.to_thread(self.sync.close)
