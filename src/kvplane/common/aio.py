"""LoopThread: one background asyncio loop per process, with a blocking portal for sync callers."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from kvplane.common.errors import Timeout

T = TypeVar("T")


class LoopThread:
    """Runs an event loop in a named daemon thread; ``run(coro, timeout)`` blocks for the result."""

    def __init__(self, name: str = "kvplane-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait(5)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for it.

        Raises:
            Timeout: if it does not finish within ``timeout`` seconds (the coroutine is cancelled).
        """
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except TimeoutError as exc:
            fut.cancel()
            raise Timeout(f"operation did not finish within {timeout}s") from exc

    def close(self, timeout: float = 5.0) -> None:
        """Stop the loop and join the thread (idempotent)."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()

    def __enter__(self) -> LoopThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
