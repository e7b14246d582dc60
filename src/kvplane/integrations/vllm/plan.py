"""Pure planning for the vLLM connectors: keys from block hashes, load and save spans.

No vLLM, torch, sockets or clocks here, so every rule is unit-tested alone.

Keys: one object per (block, layer): ``{prefix}/{dtype}/bs{block_size}/tp{rank}of{size}/
{block_hash_hex}/{layer}``. vLLM's block hash chains every earlier token of the prefix, so equal
hashes mean equal prefixes on any instance started with the same ``PYTHONHASHSEED`` and hash
algorithm; the prefix keeps different models, dtypes, block sizes and TP shards apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvplane.common.errors import InvalidArgument


@dataclass(frozen=True)
class KeySpace:
    """Where one worker's (or its scheduler's) keys live.

    Attributes:
        prefix: model namespace (see ``ConnectorConfig.model_prefix``).
        dtype: KV cache dtype name, e.g. ``float32``.
        block_size: tokens per block.
        num_layers: attention layers, each stored as its own object per block.
        tp_rank: tensor-parallel rank of the shard.
        tp_size: tensor-parallel world size.
    """

    prefix: str
    dtype: str
    block_size: int
    num_layers: int
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def root(self) -> str:
        return f"{self.prefix}/{self.dtype}/bs{self.block_size}/tp{self.tp_rank}of{self.tp_size}"

    def block_keys(self, block_hash: bytes) -> list[str]:
        """The keys of one block, one per layer, in layer order."""
        h = block_hash.hex() if isinstance(block_hash, (bytes, bytearray)) else format(block_hash, "x")
        return [f"{self.root}/{h}/{layer}" for layer in range(self.num_layers)]

    def keys(self, block_hashes: Sequence[bytes]) -> list[list[str]]:
        """Keys of each block (outer) and layer (inner)."""
        return [self.block_keys(h) for h in block_hashes]

    def of_rank(self, rank: int) -> KeySpace:
        """The same space for tensor-parallel rank ``rank`` (each rank stores its own heads)."""
        return dataclasses.replace(self, tp_rank=rank)

    def every_rank_keys(self, block_hashes: Sequence[bytes]) -> list[list[str]]:
        """Keys of each block (outer) on every rank, rank by rank, layers inner: a block is
        loadable only when all ranks' shards of it are stored."""
        spaces = [self.of_rank(r) for r in range(self.tp_size)]
        return [[k for sp in spaces for k in sp.block_keys(h)] for h in block_hashes]

    def rebase(self, keys: list[list[str]], planned_in: KeySpace) -> list[list[str]]:
        """``keys`` planned in ``planned_in`` (the scheduler's space, rank 0) moved to this
        rank's space: a worker of rank r saves and loads its own shard, never rank 0's.

        Raises:
            InvalidArgument: a key outside ``planned_in``.
        """
        src, dst = planned_in.root + "/", self.root + "/"
        if src == dst:
            return keys
        out = []
        for ks in keys:
            row = []
            for k in ks:
                if not k.startswith(src):
                    raise InvalidArgument(f"key {k!r} is not under {planned_in.root!r}")
                row.append(dst + k[len(src):])
            out.append(row)
        return out


@dataclass
class LoadJob:
    """Copy stored blocks into local blocks ``block_ids`` (same order as ``keys``)."""

    req_id: str
    block_ids: list[int]
    keys: list[list[str]]


@dataclass
class SaveJob:
    """Store local blocks ``block_ids`` under ``keys``."""

    req_id: str
    block_ids: list[int]
    keys: list[list[str]]


@dataclass
class StepPlan:
    """What the workers do this step (the connector metadata's payload). Keys are the
    scheduler's (rank 0's); each worker takes :meth:`for_rank` of it."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    def for_rank(self, space: KeySpace) -> StepPlan:
        """This plan with every key in ``space`` (a worker's), planned in its rank 0 space."""
        planned = space.of_rank(0)
        if planned.root == space.root:
            return self
        return StepPlan([LoadJob(j.req_id, j.block_ids, space.rebase(j.keys, planned))
                         for j in self.loads],
                        [SaveJob(j.req_id, j.block_ids, space.rebase(j.keys, planned))
                         for j in self.saves],
                        self.preempted)


def loadable_blocks(num_prompt_tokens: int, num_hashes: int, block_size: int) -> int:
    """Full blocks that may come from outside: never the one holding the last prompt token,
    which vLLM must compute to produce logits."""
    return max(0, min(num_hashes, (num_prompt_tokens - 1) // block_size))


def matched_tokens(present: Sequence[bool], first_block: int, num_computed: int,
                   block_size: int) -> int:
    """Tokens beyond ``num_computed`` covered by the leading run of present blocks.

    Args:
        present: for blocks ``first_block, first_block+1, ...``, whether every layer is stored.
        first_block: index of the first block checked.
        num_computed: tokens already computed locally (block aligned by vLLM).
        block_size: tokens per block.
    """
    run = 0
    for ok in present:
        if not ok:
            break
        run += 1
    return max(0, (first_block + run) * block_size - num_computed)


def blocks_present(found: Sequence[bool], num_layers: int) -> list[bool]:
    """Fold per-key presence into per-block flags (every layer present)."""
    return [all(found[i:i + num_layers]) for i in range(0, len(found), num_layers)]


def load_job(req_id: str, block_ids: Sequence[int], block_hashes: Sequence[bytes],
             num_computed: int, num_external: int, space: KeySpace) -> LoadJob | None:
    """The load for a request that was granted ``num_external`` tokens after ``num_computed``."""
    if num_external <= 0:
        return None
    bs = space.block_size
    start, stop = num_computed // bs, (num_computed + num_external) // bs
    if stop > len(block_ids) or stop > len(block_hashes):
        return None
    return LoadJob(req_id, list(block_ids[start:stop]), space.keys(block_hashes[start:stop]))


def save_span(saved: int, computed_after_step: int, num_prompt_tokens: int, num_hashes: int,
              num_block_ids: int, block_size: int) -> tuple[int, int]:
    """Blocks ``[saved, end)`` of the prompt that are complete after this step and not yet saved."""
    end = min(computed_after_step, num_prompt_tokens) // block_size
    end = min(end, num_hashes, num_block_ids)
    return saved, max(saved, end)
