"""What a policy sees and what it returns: request, cluster view, decision.

The simulator and the live router both build a :class:`ClusterView`; policies read it and never
mutate it. Prefix matches come from the conductor's :class:`~kvplane.conductor.indexer.PrefixIndex`
through a :class:`PrefixSource` (see ``prefix.py``). Pure data; must not import the simulator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvplane.conductor.indexer import Match


@dataclass(frozen=True, slots=True)
class Request:
    """One inference request as the scheduler sees it.

    Attributes:
        rid: request id (trace line number in the simulator).
        arrival_s: arrival time in seconds.
        input_length: prompt tokens.
        output_length: tokens to generate (the simulator's truth; policies must not use it
            as an oracle, Mooncake assumes a uniform decode duration instead).
        hash_ids: prefix block hashes from the root (one per ``block_tokens``; last may be partial).
    """

    rid: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(slots=True)
class PrefillLoad:
    """Load of one prefill instance.

    Attributes:
        instance: instance id.
        queue_s: predicted seconds until a new request could start (running remainder plus the
            predicted prefill time of everything queued; Mooncake's EstimatePrefillQueueTime).
        queued: requests running or waiting.
        queued_tokens: uncached prompt tokens running or waiting.
        cached_blocks: blocks in the instance's GPU cache (SGLang's "tree size").
        gpu_capacity_blocks: GPU cache capacity (llm-d's kv-usage denominator).
    """

    instance: str
    queue_s: float = 0.0
    queued: int = 0
    queued_tokens: int = 0
    cached_blocks: int = 0
    gpu_capacity_blocks: int = 1


@dataclass(slots=True)
class DecodeLoad:
    """Load of one decode instance.

    Attributes:
        instance: instance id.
        running: sequences in the batch.
        waiting: sequences admitted by the router but waiting for KV space.
        kv_tokens: KV tokens held by the batch.
        kv_capacity: KV tokens the instance can hold.
        max_batch: most sequences in one batch.
        starts: rid -> (decode start time, KV tokens) of running sequences (for prediction).
        incoming: rid -> (expected arrival at decode, KV tokens) of requests still in prefill.
    """

    instance: str
    running: int = 0
    waiting: int = 0
    kv_tokens: float = 0.0
    kv_capacity: int = 1
    max_batch: int = 1
    starts: dict[int, tuple[float, int]] = field(default_factory=dict)
    incoming: dict[int, tuple[float, int]] = field(default_factory=dict)


class PrefixSource(Protocol):
    """Prefix matches per prefill instance, read from the conductor's index."""

    def match(self, hash_ids: Sequence[int]) -> dict[str, Match]:
        """Longest prefix per prefill instance, in blocks: ``gpu`` (device), ``cpu`` (device
        then the instance's DRAM), ``longest`` (then the shared pool)."""
        ...


@dataclass(slots=True)
class ClusterView:
    """A snapshot the policy decides on.

    Attributes:
        now: current time in seconds.
        prefill: prefill instance loads, in a stable order.
        decode: decode instance loads, in a stable order.
        prefixes: where prefix matches come from.
    """

    now: float
    prefill: Sequence[PrefillLoad]
    decode: Sequence[DecodeLoad]
    prefixes: PrefixSource

    def match(self, hash_ids: Sequence[int]) -> dict[str, Match]:
        """Prefix matches of ``hash_ids`` on every prefill instance (zeros when absent)."""
        got = self.prefixes.match(hash_ids)
        for p in self.prefill:
            if p.instance not in got:
                got[p.instance] = Match()
        return got


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes, or why it is rejected.

    Attributes:
        prefill: prefill instance id (None when rejected).
        decode: decode instance id (None when rejected).
        reject: rejection reason (``ttft``, ``tbt``, ``kv``), None when admitted.
        source: instance to pull the prefix from before prefilling (Mooncake's
            TransferKVCache; the pulled blocks stay, which replicates hot prefixes).
        prefix_blocks: blocks the policy expects to reuse.
        est_ttft_s: the policy's TTFT estimate, when it makes one.
        est_tbt_s: the policy's TBT estimate, when it makes one.
    """

    prefill: str | None
    decode: str | None
    reject: str | None = None
    source: str | None = None
    prefix_blocks: int = 0
    est_ttft_s: float | None = None
    est_tbt_s: float | None = None

    @property
    def rejected(self) -> bool:
        """True when the request is refused (HTTP 429 in a live router)."""
        return self.reject is not None
