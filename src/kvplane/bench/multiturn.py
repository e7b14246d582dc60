"""Multi-turn conversations against any OpenAI-compatible endpoint: hit rate and TTFT by round.

The method of SGLang's HiCache ``bench_multiturn.py`` and LMCache's ``multi-round-qa.py``, written
for kvplane: ``clients`` conversations each run ``rounds`` turns. A turn's prompt is the whole
conversation so far (an optional prompt shared by every client, the first question, then every
earlier answer and follow-up question) plus a new question, so a turn can reuse the KV of the turn
before it if some cache still holds it. Prompts are token ids (``/v1/completions`` with a list
prompt), drawn from a seeded generator. Requests stream; the first streamed choice gives the TTFT.
The cached tokens come from the usage block (vLLM: ``--enable-prompt-tokens-details``,
``prompt_tokens_details.cached_tokens``, which counts local prefix-cache and connector hits).

Scheduling, as in the originals: a ready queue (``fifo`` or seeded ``random`` pops), at most
``max_parallel`` requests in flight, inter-arrival gaps of a ``poisson`` or ``uniform`` process at
``request_rate`` (``inf``: no gap), and an optional round barrier (no client starts round r+1
before every client finished round r).

This module owns the workload and the driver; :mod:`kvplane.bench.multiturn_report` summarises,
plots and exports. Imports only ``kvplane.common`` and httpx.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import httpx

from kvplane.common.errors import InvalidArgument

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class MultiturnConfig:
    """One multi-turn workload (the parameters SGLang's and LMCache's benchmarks made standard).

    Attributes:
        clients: concurrent conversations.
        rounds: turns per conversation.
        request_length: tokens of the first question of each conversation.
        sub_question_length: tokens of each follow-up question (0: ``request_length``).
        output_length: tokens generated per turn (``ignore_eos``, greedy).
        shared_prefix: tokens of a prompt every conversation starts with (LMCache's shared system
            prompt; 0: none).
        max_parallel: most requests in flight at once.
        request_rate: mean requests per second the sender starts (``inf``: as fast as allowed).
        distribution: inter-arrival gaps, ``poisson`` (exponential) or ``uniform`` (0..2/rate).
        round_barrier: no client starts round r+1 before every client has finished round r.
        queue_policy: which ready conversation goes next, ``fifo`` or ``random`` (seeded).
        seed: seed of every token and every random choice.
        vocab: token ids are drawn from ``[first_token, vocab)``.
        first_token: lowest token id drawn (skip the tokenizer's special ids).
        timeout_s: seconds one request may take before it counts as failed.
        trace_block: tokens per block of the exported trace's ``hash_ids`` (the engine's block size).
    """

    clients: int = 8
    rounds: int = 10
    request_length: int = 192
    sub_question_length: int = 0
    output_length: int = 16
    shared_prefix: int = 0
    max_parallel: int = 2
    request_rate: float = math.inf
    distribution: Literal["poisson", "uniform"] = "poisson"
    round_barrier: bool = True
    queue_policy: Literal["fifo", "random"] = "fifo"
    seed: int = 0
    vocab: int = 1000
    first_token: int = 3
    timeout_s: float = 300.0
    trace_block: int = 32

    def __post_init__(self) -> None:
        positive = {"clients": self.clients, "rounds": self.rounds, "max_parallel": self.max_parallel,
                    "request_length": self.request_length, "output_length": self.output_length,
                    "timeout_s": self.timeout_s, "trace_block": self.trace_block}
        bad = [k for k, v in positive.items() if v <= 0]
        if bad or self.sub_question_length < 0 or self.shared_prefix < 0 or self.request_rate <= 0:
            raise InvalidArgument(f"multiturn: {bad or 'lengths and rate'} must be positive")
        if self.distribution not in ("poisson", "uniform") or self.queue_policy not in ("fifo", "random"):
            raise InvalidArgument(f"multiturn: unknown distribution {self.distribution!r} or "
                                  f"queue policy {self.queue_policy!r}")
        if not 0 <= self.first_token < self.vocab:
            raise InvalidArgument("multiturn: need 0 <= first_token < vocab")

    @property
    def follow_up(self) -> int:
        """Tokens of each follow-up question."""
        return self.sub_question_length or self.request_length

    def prompt_tokens(self, rnd: int) -> int:
        """Prompt length of round ``rnd`` (1-based)."""
        return (self.shared_prefix + self.request_length + (rnd - 1) * self.follow_up
                + (rnd - 1) * self.output_length)

    def working_set_tokens(self, rnd: int) -> int:
        """Distinct prompt tokens every conversation holds after round ``rnd`` (shared prefix once)."""
        own = self.prompt_tokens(rnd) - self.shared_prefix + self.output_length
        return self.shared_prefix + self.clients * own


@dataclass
class RequestRecord:
    """What one request did.

    Attributes:
        client: conversation index.
        round: 1-based turn.
        prompt_tokens: prompt length (the server's count when it reports usage).
        cached_tokens: prompt tokens served from a cache, None if the server did not say.
        ttft_s: seconds from sending to the first streamed choice (None: failed before it).
        latency_s: seconds from sending to the end of the stream.
        output_tokens: tokens the server streamed back.
        start_s: send time, seconds after the run began.
        backend: the instance that served it (``x-kvplane-backend`` of ``kvplane router``), or "".
        error: why it failed, or "".
        hash_ids: block-chain ids of the prompt (``trace_block`` tokens per block), for the trace.
    """

    client: int
    round: int
    prompt_tokens: int
    cached_tokens: int | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    output_tokens: int = 0
    start_s: float = 0.0
    backend: str = ""
    error: str = ""
    hash_ids: list[int] = field(default_factory=list, repr=False)

    def row(self) -> dict[str, Any]:
        """The record as a flat dict (CSV/JSON), without ``hash_ids``."""
        out = asdict(self)
        out.pop("hash_ids")
        return out


class Workload:
    """The token ids of every conversation: seeded, identical for every endpoint it is sent to.

    Args:
        cfg: the workload.
    """

    def __init__(self, cfg: MultiturnConfig) -> None:
        self.cfg = cfg
        self._rng = random.Random(cfg.seed)
        self.shared = self._tokens(cfg.shared_prefix)
        self.history = [self.shared + self._tokens(cfg.request_length) for _ in range(cfg.clients)]
        self._block_ids: dict[bytes, int] = {}

    def _tokens(self, n: int) -> list[int]:
        lo, hi = self.cfg.first_token, self.cfg.vocab - 1
        return [self._rng.randint(lo, hi) for _ in range(n)]

    def prompt(self, client: int) -> list[int]:
        """The next prompt of ``client`` (its history so far)."""
        return list(self.history[client])

    def advance(self, client: int, answer: Sequence[int]) -> None:
        """Append the answer (padded or cut to ``output_length``) and the next question."""
        cfg = self.cfg
        ans = list(answer[:cfg.output_length])
        ans += self._tokens(cfg.output_length - len(ans))
        self.history[client] += ans + self._tokens(cfg.follow_up)

    def hash_ids(self, tokens: Sequence[int]) -> list[int]:
        """Ids of the prompt's blocks: equal ids mean equal prefixes (the trace's ``hash_ids``).

        Each full block's id names its whole prefix chain; a partial last block gets a fresh id.
        """
        bs, parent = self.cfg.trace_block, b""
        out: list[int] = []
        for start in range(0, len(tokens), bs):
            block = tokens[start:start + bs]
            if len(block) < bs:
                out.append(len(self._block_ids) + 1_000_000_000 + len(out))
                break
            parent = hashlib.blake2b(parent + json.dumps(block).encode(), digest_size=16).digest()
            out.append(self._block_ids.setdefault(parent, len(self._block_ids)))
        return out


class ReadyQueue:
    """Conversations ready to send their next turn, popped FIFO or at (seeded) random."""

    def __init__(self, policy: str, rng: random.Random) -> None:
        self.policy, self.rng, self.items = policy, rng, list[int]()

    def push(self, client: int) -> None:
        """Mark ``client`` ready."""
        self.items.append(client)

    def pop(self) -> int | None:
        """The next ready client, or None."""
        if not self.items:
            return None
        return self.items.pop(self.rng.randrange(len(self.items)) if self.policy == "random" else 0)


@dataclass
class Endpoint:
    """Where to send the requests.

    Attributes:
        url: base URL of the OpenAI-compatible server (``http://host:port``).
        model: served model name ("": ask ``/v1/models``).
        headers: extra headers (e.g. ``Authorization``).
        vllm_extras: send vLLM's request fields (``ignore_eos``, ``return_token_ids``); turn off
            for servers that reject unknown fields.
    """

    url: str
    model: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)
    vllm_extras: bool = True


class _Run:
    """One pass of the workload over one endpoint (the sender loop and the per-request calls)."""

    def __init__(self, cfg: MultiturnConfig, ep: Endpoint, progress: Progress | None) -> None:
        self.cfg, self.ep, self.progress = cfg, ep, progress
        self.work = Workload(cfg)
        self.rng = random.Random(cfg.seed + 1)
        self.queue = ReadyQueue(cfg.queue_policy, self.rng)
        self.records: list[RequestRecord] = []
        self.round_of = [0] * cfg.clients  # rounds each client has finished
        self.parked: list[int] = []  # finished the current round, waiting at the barrier
        self.inflight = 0
        self.changed = asyncio.Event()
        self.total = cfg.clients * cfg.rounds
        self.t0 = 0.0

    async def run(self, client: httpx.AsyncClient, until_round: int | None = None) -> list[RequestRecord]:
        """Send requests until every client has finished ``until_round`` (None: the last round).

        A later call goes on from there (with the round barrier, no request of the next round
        has been sent when this returns). Returns the records so far.
        """
        if not self.t0:
            for c in range(self.cfg.clients):
                self.queue.push(c)
            self.t0 = time.perf_counter()
        target = self.cfg.clients * (until_round or self.cfg.rounds)
        tasks: set[asyncio.Task[None]] = set()
        while len(self.records) < target:
            nxt = self.queue.pop() if self.inflight < self.cfg.max_parallel else None
            if nxt is None:
                self.changed.clear()
                await self.changed.wait()
                continue
            self.inflight += 1
            task = asyncio.create_task(self._turn(client, nxt))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            gap = self._gap()
            if gap > 0:
                await asyncio.sleep(gap)  # the arrival process itself, not a wait for a state
        await asyncio.gather(*tasks)
        return sorted(self.records, key=lambda r: (r.round, r.start_s))

    def _gap(self) -> float:
        rate = self.cfg.request_rate
        if math.isinf(rate):
            return 0.0
        if self.cfg.distribution == "poisson":
            return self.rng.expovariate(rate)
        return self.rng.uniform(0, 2 / rate)

    async def _turn(self, client: httpx.AsyncClient, c: int) -> None:
        prompt = self.work.prompt(c)
        rec = RequestRecord(c, self.round_of[c] + 1, len(prompt),
                            hash_ids=self.work.hash_ids(prompt))
        answer: list[int] = []
        try:
            answer = await self._send(client, prompt, rec)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            self._finish(c, rec, answer)

    def _finish(self, c: int, rec: RequestRecord, answer: list[int]) -> None:
        self.records.append(rec)
        self.inflight -= 1
        self.round_of[c] += 1
        if self.round_of[c] < self.cfg.rounds:
            self.work.advance(c, answer)
            if self.cfg.round_barrier:
                self.parked.append(c)
                if len(self.parked) == self.cfg.clients:
                    for p in self.parked:
                        self.queue.push(p)
                    self.parked.clear()
            else:
                self.queue.push(c)
        if self.progress is not None:
            self.progress(len(self.records), self.total)
        self.changed.set()

    def _body(self, prompt: list[int]) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.ep.model, "prompt": prompt,
                                "max_tokens": self.cfg.output_length, "temperature": 0.0,
                                "stream": True, "stream_options": {"include_usage": True}}
        if self.ep.vllm_extras:
            body.update(ignore_eos=True, return_token_ids=True)
        return body

    async def _send(self, client: httpx.AsyncClient, prompt: list[int],
                    rec: RequestRecord) -> list[int]:
        """Stream one completion; fills ``rec``; returns the generated token ids (if sent)."""
        start = time.perf_counter()
        rec.start_s = start - self.t0
        answer: list[int] = []
        async with client.stream("POST", "/v1/completions", json=self._body(prompt)) as resp:
            rec.backend = resp.headers.get("x-kvplane-backend", "")
            if resp.status_code != 200:
                await resp.aread()
                raise ValueError(f"HTTP {resp.status_code}: {resp.text[:200]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                for choice in chunk.get("choices") or ():
                    if rec.ttft_s is None:
                        rec.ttft_s = time.perf_counter() - start
                    ids = choice.get("token_ids") or ()
                    answer += ids
                    rec.output_tokens += len(ids) or int(bool(choice.get("text")))
                _usage(chunk.get("usage"), rec)
        rec.latency_s = time.perf_counter() - start
        if rec.ttft_s is None:
            raise ValueError("the stream ended without a token")
        return answer


def _usage(usage: Mapping[str, Any] | None, rec: RequestRecord) -> None:
    """Take the prompt and cached token counts from a usage block, if there is one."""
    if not usage:
        return
    rec.prompt_tokens = int(usage.get("prompt_tokens") or rec.prompt_tokens)
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        rec.cached_tokens = int(details["cached_tokens"])
    if usage.get("completion_tokens") is not None:
        rec.output_tokens = int(usage["completion_tokens"])


async def _model_name(client: httpx.AsyncClient) -> str:
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


def _client(cfg: MultiturnConfig, ep: Endpoint,
            transport: httpx.AsyncBaseTransport | None) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=ep.url, headers=dict(ep.headers),
                             limits=httpx.Limits(max_connections=cfg.max_parallel + 2,
                                                 keepalive_expiry=2.0),  # before vLLM's 5 s
                             timeout=httpx.Timeout(cfg.timeout_s, connect=10.0), trust_env=False,
                             transport=transport)


async def run_async(cfg: MultiturnConfig, ep: Endpoint, progress: Progress | None = None,
                    transport: httpx.AsyncBaseTransport | None = None) -> list[RequestRecord]:
    """Run the workload once against ``ep``.

    Args:
        cfg: the workload.
        ep: the endpoint.
        progress: called with (requests done, total) after every request.
        transport: httpx transport to send through (tests pass a fake; None: the network).

    Returns:
        One record per request, by round then send time. A failed request is a record with
        ``error`` set; its conversation goes on with a generated answer.
    """
    return (await run_interleaved_async(cfg, {"": ep}, {"": progress} if progress else None,
                                        {"": transport} if transport else None))[""]


async def run_interleaved_async(
        cfg: MultiturnConfig, endpoints: Mapping[str, Endpoint],
        progress: Mapping[str, Progress] | None = None,
        transports: Mapping[str, httpx.AsyncBaseTransport] | None = None,
) -> dict[str, list[RequestRecord]]:
    """Run the same workload on every endpoint, round by round in turn (one round of the first
    endpoint, the same round of the second, ...), so slow drifts of the machine's load hit every
    endpoint alike. With a single endpoint this is a plain run.

    Raises:
        InvalidArgument: several endpoints without the round barrier (rounds would not exist).
    """
    if len(endpoints) > 1 and not cfg.round_barrier:
        raise InvalidArgument("interleaving endpoints needs the round barrier")
    async with contextlib.AsyncExitStack() as stack:
        runs: dict[str, tuple[_Run, httpx.AsyncClient]] = {}
        for label, ep in endpoints.items():
            client = await stack.enter_async_context(
                _client(cfg, ep, (transports or {}).get(label)))
            if not ep.model:
                ep = Endpoint(ep.url, await _model_name(client), ep.headers, ep.vllm_extras)
            runs[label] = (_Run(cfg, ep, (progress or {}).get(label)), client)
        out: dict[str, list[RequestRecord]] = {}
        rounds = range(1, cfg.rounds + 1) if len(runs) > 1 else [cfg.rounds]
        for rnd in rounds:
            for label, (run_, client) in runs.items():
                out[label] = await run_.run(client, rnd)
        return out


def run(cfg: MultiturnConfig, ep: Endpoint, progress: Progress | None = None) -> list[RequestRecord]:
    """Blocking :func:`run_async` (its own event loop)."""
    return asyncio.run(run_async(cfg, ep, progress))


def run_interleaved(cfg: MultiturnConfig, endpoints: Mapping[str, Endpoint],
                    progress: Mapping[str, Progress] | None = None) -> dict[str, list[RequestRecord]]:
    """Blocking :func:`run_interleaved_async` (its own event loop)."""
    return asyncio.run(run_interleaved_async(cfg, endpoints, progress))
