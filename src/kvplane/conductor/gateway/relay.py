"""Streaming pieces of the proxy: SSE event framing, the error event, racing a read against ejection,
stopping background tasks for good.

Pure asyncio plus httpx types; no FastAPI. Must not bind sockets.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")
MAX_EVENT = 8 << 20  # one SSE event larger than this is a broken upstream


class BackendGone(Exception):
    """The backend was ejected while this call waited on it."""


async def race(aw: Awaitable[T], gone: asyncio.Event, grace: float = 0.0) -> T:
    """Await ``aw`` unless ``gone`` fires first; then give ``aw`` ``grace`` more seconds.

    A backend ejected by its health checks may still be streaming (its ``/health`` was slow, not
    dead): a read that completes within the grace is returned as usual, so a live stream goes on
    while every read keeps arriving within ``grace`` of the previous one.

    Raises:
        BackendGone: ``gone`` was set and ``aw`` did not finish within the grace (it is cancelled).
    """
    task = asyncio.ensure_future(aw)
    try:
        if not gone.is_set():
            waiter = asyncio.ensure_future(gone.wait())
            try:
                await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
        if not task.done() and grace > 0:
            await asyncio.wait({task}, timeout=grace)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if task.done():
        return task.result()
    task.cancel()
    raise BackendGone()


async def stop_tasks(tasks: Iterable[asyncio.Future[Any]], timeout: float = 5.0) -> list[asyncio.Future[Any]]:
    """Cancel ``tasks`` and wait until they end, cancelling again every 0.1 s; returns those
    still running after ``timeout`` (left to the event loop's own shutdown).

    One cancel is not always enough: Python 3.11's ``asyncio.wait_for`` drops a cancellation
    that arrives as the awaited call completes, and a health-check loop that lost it kept the
    router's shutdown waiting forever (seen under load: SIGTERM, then kill -9 after 20 s).
    """
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    end = time.monotonic() + timeout
    while pending:
        left = end - time.monotonic()
        if left <= 0:
            return list(pending)
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=min(0.1, left))
    for t in tasks:  # mark their outcome as seen (no "exception was never retrieved")
        if not t.cancelled():
            t.exception()
    return []


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Re-frame a byte stream into whole SSE events (each ends with a blank line).

    Token-by-token relay needs no more than this: vLLM flushes one event per generated token, and
    an event is forwarded as soon as its blank line arrives. A trailing partial event (the
    upstream closed mid-event) is dropped: the caller then sees the stream end early.

    Raises:
        ValueError: one event exceeds :data:`MAX_EVENT` bytes.
    """
    buf = b""
    async for chunk in chunks:
        buf += chunk.replace(b"\r\n", b"\n") if b"\r" in chunk else chunk
        while True:
            cut = buf.find(b"\n\n")
            if cut < 0:
                break
            event, buf = buf[:cut + 2], buf[cut + 2:]
            if event.strip():
                yield event
        if len(buf) > MAX_EVENT:
            raise ValueError("SSE event too large")


def is_data(event: bytes) -> bool:
    """True for an event with a non-empty ``data:`` field (a token, usage or [DONE])."""
    return any(line.startswith(b"data:") and line[5:].strip() for line in event.split(b"\n"))


def error_event(message: str, code: int = 502, kind: str = "upstream_error") -> bytes:
    """An OpenAI-style error as one SSE event, followed by ``[DONE]`` (the stream ends cleanly)."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"


def error_body(message: str, code: int, kind: str = "upstream_error") -> dict[str, object]:
    """The JSON body of a non-streamed error answer (OpenAI's shape)."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
