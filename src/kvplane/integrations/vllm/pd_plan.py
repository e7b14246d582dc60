"""Pure planning for KVPlanePDConnector: which prefill blocks land in which decode blocks.

No vLLM, torch, sockets or clocks; unit-tested alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvplane.common.errors import InvalidArgument
from kvplane.integrations.vllm.layout import KVLayout, LayerSpan
from kvplane.transfer import OpCode, TransferRequest


@dataclass
class PullJob:
    """Read ``remote_blocks`` of a prefill instance into local ``local_blocks``."""

    req_id: str
    local_blocks: list[int]
    remote_blocks: list[int]
    segment: str
    notify: str
    layers: list[list[int]]
    remote_req_id: str


REQUIRED = {"remote_segment": str, "remote_notify": str, "remote_layers": list,
            "remote_block_ids": list}


def params_ok(params: dict[str, Any]) -> bool:
    """Whether decode-side ``kv_transfer_params`` carry everything a pull needs."""
    return all(isinstance(params.get(k), t) for k, t in REQUIRED.items())


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
    try:
        layers = [[int(x) for x in s] for s in params["remote_layers"]] if remote else []
        if any(len(s) not in (3, 4) for s in layers):  # [base, bytes, blocks(, stride)]
            raise ValueError("bad remote layer")
    except (TypeError, ValueError):
        layers, remote = [], []
    if stop > len(remote) or len(local) != stop - start:
        remote = []
    return PullJob(req_id, local, remote[start:stop], segment, notify, layers, rid)


def read_requests(job: PullJob, local: KVLayout, handle: int) -> list[TransferRequest]:
    """One READ per (block, layer) from the prefill layout into the local one (pure)."""
    remote = KVLayout.from_spans([LayerSpan(*s) for s in job.layers])
    if remote.num_layers != local.num_layers or any(
            r.block_bytes != lo.block_bytes for r, lo in zip(remote.layers, local.layers)):
        raise InvalidArgument("prefill and decode KV layouts differ (model, dtype or block size)")
    src, sizes = remote.block_addrs(job.remote_blocks)
    dst, _ = local.block_addrs(job.local_blocks)
    return [TransferRequest(OpCode.READ, d, handle, s, n) for d, s, n in zip(dst, src, sizes)]
