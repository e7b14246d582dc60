"""Pure planning for KVPlanePDConnector: which prefill blocks land in which decode blocks.

No vLLM, torch, sockets or clocks; unit-tested alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from kvplane.common.errors import InvalidArgument
from kvplane.integrations.vllm.layout import KVLayout, LayerSpan
from kvplane.transfer import OpCode, TransferRequest


@dataclass
class RankPeer:
    """One prefill tensor-parallel rank: its segment, notification address and KV layers."""

    segment: str
    notify: str
    layers: list[list[int]]


@dataclass
class PullJob:
    """Read ``remote_blocks`` of a prefill instance into local ``local_blocks``.

    ``segment``/``notify``/``layers`` name prefill rank 0; ``ranks`` lists every prefill TP rank
    (empty from a prefill side that sent one rank). A decode worker runs ``on_rank(...)``.
    ``release`` holds further notification addresses this worker owes a release to.
    """

    req_id: str
    local_blocks: list[int]
    remote_blocks: list[int]
    segment: str
    notify: str
    layers: list[list[int]]
    remote_req_id: str
    ranks: list[RankPeer] = field(default_factory=list)
    release: list[str] = field(default_factory=list)

    def on_rank(self, rank: int, tp_size: int) -> PullJob:
        """The job decode TP rank ``rank`` of ``tp_size`` runs (pure).

        With tensor parallelism each rank holds its own shard of every layer (its heads), so
        decode rank r reads prefill rank r's blocks and releases prefill rank r. When the two
        sides' TP sizes differ the shards do not line up: nothing is read (the blocks are
        recomputed, never filled from another rank's shard) and each prefill rank is still
        released by exactly one decode rank (rank i by decode rank ``i % tp_size``).
        """
        ranks = self.ranks or [RankPeer(self.segment, self.notify, self.layers)]
        if len(ranks) == tp_size and 0 <= rank < tp_size:
            p = ranks[rank]
            return replace(self, segment=p.segment, notify=p.notify, layers=p.layers, ranks=[],
                           release=[])
        mine = [p.notify for i, p in enumerate(ranks) if i % tp_size == rank and p.notify]
        return replace(self, remote_blocks=[], segment="", layers=[], ranks=[],
                       notify=mine[0] if mine else "", release=mine[1:])

    def notifies(self) -> list[str]:
        """Every prefill notification address this job releases."""
        return [a for a in [self.notify, *self.release] if a]


REQUIRED = {"remote_segment": str, "remote_notify": str, "remote_layers": list,
            "remote_block_ids": list}


def params_ok(params: dict[str, Any]) -> bool:
    """Whether decode-side ``kv_transfer_params`` carry everything a pull needs."""
    return all(isinstance(params.get(k), t) for k, t in REQUIRED.items())


def _layers(raw: Any) -> list[list[int]]:
    layers = [[int(x) for x in s] for s in raw]
    if any(len(s) not in (3, 4) for s in layers):  # [base, bytes, blocks(, stride)]
        raise ValueError("bad remote layer")
    return layers


def _ranks(raw: Any) -> list[RankPeer]:
    """``remote_ranks`` of the params (``[]`` when absent).

    Raises:
        ValueError, TypeError: malformed.
    """
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise TypeError("remote_ranks must be a list")
    return [RankPeer(str(r["segment"]), str(r.get("notify", "")), _layers(r["layers"]))
            for r in raw]


def pull_job(req_id: str, params: dict[str, Any], local_blocks: list[int], num_computed: int,
             num_external: int, block_size: int) -> PullJob:
    """The read that fills tokens ``[num_computed, num_computed + num_external)`` (pure).

    A job whose ``remote_blocks`` is empty while ``local_blocks`` is not cannot be served (bad
    params or too few prefill blocks): the worker reports those blocks as failed, so vLLM
    recomputes them instead of trusting unwritten KV.
    """
    start = num_computed // block_size
    stop = -(-(num_computed + num_external) // block_size) if num_external > 0 else start
    local = list(local_blocks[start:stop])
    notify, segment = str(params.get("remote_notify", "")), str(params.get("remote_segment", ""))
    rid = str(params.get("remote_request_id", ""))
    remote = list(params.get("remote_block_ids") or []) if params_ok(params) else []
    ranks: list[RankPeer] = []
    try:
        layers = _layers(params["remote_layers"]) if remote else []
        ranks = _ranks(params.get("remote_ranks"))
    except (TypeError, ValueError, KeyError, AttributeError):
        layers, remote = [], []
    if stop > len(remote) or len(local) != stop - start:
        remote = []
    return PullJob(req_id, local, remote[start:stop], segment, notify, layers, rid, ranks)


def read_requests(job: PullJob, local: KVLayout, handle: int) -> list[TransferRequest]:
    """One READ per (block, layer) from the prefill layout into the local one (pure)."""
    remote = KVLayout.from_spans([LayerSpan(*s) for s in job.layers])
    if remote.num_layers != local.num_layers or any(
            r.block_bytes != lo.block_bytes for r, lo in zip(remote.layers, local.layers)):
        raise InvalidArgument("prefill and decode KV layouts differ (model, dtype or block size)")
    src, sizes = remote.block_addrs(job.remote_blocks)
    dst, _ = local.block_addrs(job.local_blocks)
    return [TransferRequest(OpCode.READ, d, handle, s, n) for d, s, n in zip(dst, src, sizes)]
