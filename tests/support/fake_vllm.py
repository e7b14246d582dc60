"""A fake vLLM OpenAI server for router tests: vLLM's endpoints, metrics and KV events, scripted faults.

``FakeVLLM`` serves ``/health``, ``/metrics`` (vLLM's metric names), ``/tokenize`` (a word-level
tokenizer like the e2e tiny model's: ``"t5 t6"`` -> ``[5, 6]``), ``/v1/models`` and
``/v1/completions`` + ``/v1/chat/completions`` (streamed or not; the generated tokens are a pure
function of the prompt, so any two instances answer alike). It keeps a prefix cache of block
hashes computed as vLLM does and, when given a ZMQ endpoint, publishes ``BlockStored`` events in
vLLM's wire format, so a router's index learns what each fake holds.

Faults are attributes set by the test at any time: ``fail_status`` (answer completions with it),
``die_after`` (drop the connection after that many streamed events; 0 = before the first),
``stall`` (completions wait on :attr:`release`), ``stall_after`` (a stream stops after that many
events until :attr:`release`), ``token_delay`` (seconds between streamed events),
``health_status`` / ``health_stall``.
``router_over_fakes`` starts an in-process router in front of a few of them.
Test kit, not product.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvplane.common.http import ServerThread
from kvplane.conductor.hashing import HashProfile


class FakeVLLM:
    """One fake vLLM server on 127.0.0.1 (port 0).

    Args:
        block_size: KV block size reported in ``cache_config_info`` and used for hashing.
        events: ZMQ endpoint to connect a publisher to (a router's ``--bind``), or None
            (:meth:`attach` can connect one later).
        topic: topic of the published events.
        model: served model name.
    """

    def __init__(self, block_size: int = 4, events: str | None = None, topic: str = "",
                 model: str = "fake") -> None:
        self.block_size, self.model = block_size, model
        self.profile = HashProfile("sha256", "0", "vllm_v1_tagged")
        self.cached: set[int] = set()
        self.requests: list[dict[str, Any]] = []
        self.queries = self.hits = 0
        self.running = self.waiting = 0
        self.fail_status: int | None = None
        self.die_after: int | None = None
        self.stall_after: int | None = None
        self.stall = False
        self.release = threading.Event()
        self.health_status = 200
        self.health_stall = False
        self.token_delay = 0.0
        self.headers: list[dict[str, str]] = []
        self.publisher: Any = None
        if events is not None:
            self.attach(events, topic)
        self.server = ServerThread(self._app())
        self.url = self.server.url
        self.id = self.url.split("://", 1)[1]

    def attach(self, endpoint: str, topic: str, timeout: float = 10.0) -> None:
        """Publish KV events to ``endpoint`` (a router's bound SUB) under ``topic``."""
        from kvplane.kvevents.publisher import KVEventPublisher

        self.publisher = KVEventPublisher(connect=endpoint, topic=topic, replay=True)
        self.publisher.wait_subscribed(timeout)

    # behaviour ------------------------------------------------------------------------------
    @staticmethod
    def tokenize(text: str) -> list[int]:
        """The word-level tokenizer: ``tN`` -> N, anything else -> 0."""
        return [int(w[1:]) if w[:1] == "t" and w[1:].isdigit() else 0 for w in text.split()]

    @staticmethod
    def generate(prompt: list[int], n: int) -> list[int]:
        """The tokens any fake generates for ``prompt`` (deterministic)."""
        seed = sum(prompt) + len(prompt)
        return [(seed * 31 + i * 7) % 997 + 3 for i in range(n)]

    def _prompt(self, body: dict[str, Any]) -> list[int]:
        if "messages" in body:
            return self.tokenize(" ".join(str(m.get("content", "")) for m in body["messages"]))
        p = body.get("prompt", "")
        return list(p) if isinstance(p, list) else self.tokenize(str(p))

    def _cache(self, tokens: list[int]) -> int:
        """vLLM's prefix cache: count queried/hit tokens, store new blocks, publish them.

        Returns the prompt tokens served from the cache (vLLM's ``num_cached_tokens``)."""
        hashes = list(self.profile.event_hashes(tokens, self.block_size))
        hit = 0
        for h in hashes:
            if h not in self.cached:
                break
            hit += 1
        self.queries += len(tokens)
        self.hits += hit * self.block_size
        new = hashes[hit:]
        if new:
            self.cached.update(new)
            if self.publisher is not None:
                from kvplane.kvevents import stored

                parent = hashes[hit - 1] if hit else None
                toks = tokens[hit * self.block_size:len(hashes) * self.block_size]
                self.publisher.publish([stored(new, toks, self.block_size, parent=parent)])
        return hit * self.block_size

    # app --------------------------------------------------------------------------------------
    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            while self.health_stall:
                await asyncio.sleep(0.02)
            return Response(status_code=self.health_status)

        @app.get("/metrics")
        def metrics() -> Response:
            lab = f'engine="0",model_name="{self.model}"'
            text = (f"vllm:num_requests_running{{{lab}}} {self.running}\n"
                    f"vllm:num_requests_waiting{{{lab}}} {self.waiting}\n"
                    f"vllm:prefix_cache_queries_total{{{lab}}} {self.queries}\n"
                    f"vllm:prefix_cache_hits_total{{{lab}}} {self.hits}\n"
                    f'vllm:cache_config_info{{block_size="{self.block_size}",engine="0",'
                    f'kv_cache_size_tokens="4096",prefix_caching_hash_algo="sha256"}} 1.0\n')
            return Response(text, media_type="text/plain")

        @app.post("/tokenize")
        async def tokenize(request: Request) -> Response:
            body = await request.json()
            tokens = self._prompt(body)
            return JSONResponse({"count": len(tokens), "tokens": tokens})

        @app.get("/v1/models")
        def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": self.model, "object": "model"}]}

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            self.headers.append(dict(request.headers))
            return await self._complete(await request.json(), chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            self.headers.append(dict(request.headers))
            return await self._complete(await request.json(), chat=True)

        return app

    async def _complete(self, body: dict[str, Any], chat: bool) -> Response:
        self.requests.append(body)
        while self.stall and not self.release.is_set():
            await asyncio.sleep(0.02)
        if self.fail_status is not None:
            return JSONResponse({"error": {"message": "scripted failure"}}, self.fail_status)
        prompt = self._prompt(body)
        cached = self._cache(prompt)
        out = self.generate(prompt, int(body.get("max_tokens") or 4))
        if not body.get("stream"):
            if self.die_after is not None:
                raise ConnectionAbortedError("scripted death")  # uvicorn drops the connection
            text = "".join(f" t{t}" for t in out)
            choice = ({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            return JSONResponse({"model": self.model, "choices": [{"index": 0, **choice,
                                                                   "finish_reason": "length"}],
                                 "kv_transfer_params": body.get("kv_transfer_params")})
        usage = None
        if (body.get("stream_options") or {}).get("include_usage"):  # as --enable-prompt-tokens-details
            usage = {"prompt_tokens": len(prompt), "completion_tokens": len(out),
                     "total_tokens": len(prompt) + len(out),
                     "prompt_tokens_details": {"cached_tokens": cached}}
        return StreamingResponse(self._events(out, chat, bool(body.get("return_token_ids")), usage),
                                 media_type="text/event-stream")

    async def _events(self, out: list[int], chat: bool, ids: bool = False,
                      usage: dict[str, Any] | None = None) -> AsyncIterator[bytes]:
        for i, t in enumerate(out):
            if self.die_after is not None and i >= self.die_after:
                raise ConnectionAbortedError("scripted death mid-stream")
            while self.stall_after is not None and i >= self.stall_after and not self.release.is_set():
                await asyncio.sleep(0.02)
            piece: dict[str, Any] = {"delta": {"content": f" t{t}"}} if chat else {"text": f" t{t}"}
            if ids:
                piece["token_ids"] = [t]
            yield b"data: " + json.dumps({"choices": [{"index": 0, **piece}]}).encode() + b"\n\n"
            if self.token_delay:
                await asyncio.sleep(self.token_delay)
        if usage is not None:
            yield b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    def close(self) -> None:
        """Stop serving (new connections are refused) and close the publisher."""
        self.release.set()
        self.health_stall = False
        self.server.close()
        if self.publisher is not None:
            self.publisher.close()

    def __enter__(self) -> FakeVLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def words(*ids: int) -> str:
    """A prompt the fakes' tokenizer maps to ``ids``."""
    return " ".join(f"t{i}" for i in ids)


@contextlib.contextmanager
def router_over_fakes(n: int = 3, roles: tuple[str, ...] = (), block_size: int = 4,
                      **config: Any) -> Iterator[tuple[Any, list[FakeVLLM]]]:
    """``n`` fakes publishing KV events to a started in-process ``GatewayServer``.

    Args:
        n: number of fakes.
        roles: ``prefill``/``decode`` per fake (PD mode); empty = colocated.
        block_size: the fakes' KV block size.
        config: further :class:`GatewayConfig` fields (policy, reject, token, ...).

    Yields:
        (the started server, the fakes in backend order).
    """
    from kvplane.conductor.gateway.config import BackendSpec, GatewayConfig
    from kvplane.conductor.gateway.server import GatewayServer

    fakes = [FakeVLLM(block_size=block_size) for _ in range(n)]
    roles = roles or ("both",) * n
    server = None
    try:
        specs = tuple(BackendSpec(f.url, role) for f, role in zip(fakes, roles))  # type: ignore[arg-type]
        cfg = GatewayConfig(port=0, backends=specs, bind=("tcp://127.0.0.1:0",),
                            mode="pd" if "prefill" in roles else "colocated", **config)
        server = GatewayServer(cfg).start()
        (endpoint,) = server.zmq_endpoints
        for f, spec in zip(fakes, specs):
            f.attach(endpoint, spec.topic)
        yield server, fakes
    finally:
        if server is not None:
            server.close()
        for f in fakes:
            f.close()
