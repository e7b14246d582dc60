"""``MooncakeDistributedStoreAsync`` (``mooncake.async_store``): every store method ``m`` also
as ``await store.async_m(...)``, run in the event loop's default executor (as Mooncake does)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any

from kvplane.compat.mooncake_store import MooncakeDistributedStore


class MooncakeDistributedStoreAsync(MooncakeDistributedStore):
    """The store with ``async_<method>`` coroutine twins of its methods."""

    def __getattr__(self, name: str) -> Callable[..., Coroutine[Any, Any, Any]]:
        if not name.startswith("async_"):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        sync = getattr(self, name[len("async_"):], None)
        if not callable(sync):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

        @functools.wraps(sync)
        async def call(*args: Any, **kwargs: Any) -> Any:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, functools.partial(sync, *args, **kwargs))

        setattr(self, name, call)
        return call


__all__ = ["MooncakeDistributedStoreAsync"]
