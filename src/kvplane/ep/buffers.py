"""``kvplane.ep.Buffer``: DeepEP's Buffer API for elastic expert parallelism on CPU.

Normal mode (``get_dispatch_layout``/``dispatch``/``combine``) and the low-latency pair
(``low_latency_dispatch``/``low_latency_combine``) follow DeepEP's signatures, plus Mooncake EP's
``active_ranks`` (int32 ``[num_ranks]``, updated in place) and ``timeout_us`` as keyword
arguments. A rank that misses the deadline is cleared in ``active_ranks`` and skipped from then
on; its experts contribute nothing. Events and hooks are ``None`` (everything is synchronous).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kvplane.collectives import KvplaneProcessGroup
from kvplane.common.errors import InvalidArgument
from kvplane.ep import topology
from kvplane.ep.dispatch import exchange


@dataclass
class DispatchHandle:
    """What ``combine`` needs to send results back (opaque to callers).

    Attributes:
        src_token: int64 ``[num_recv]`` index of each received row in its source's ``x``.
        counts: rows received from each source rank.
        num_tokens: tokens of this rank's ``x`` at dispatch time.
    """

    src_token: torch.Tensor
    counts: list[int]
    num_tokens: int


@dataclass
class LowLatencyHandle:
    """Layout of a low-latency dispatch (opaque to callers).

    Attributes:
        src_token: int64 ``[num_recv]`` source token index of each received (token, expert) row.
        local_expert: int64 ``[num_recv]`` local expert of each received row.
        slot: int64 ``[num_recv]`` row of ``recv_x[local_expert]`` it was placed in.
        counts: rows received from each source rank.
        num_tokens: tokens of this rank's ``x``.
        num_max_dispatch_tokens_per_rank: as passed to dispatch.
        hidden: hidden size.
        num_experts: total experts.
    """

    src_token: torch.Tensor
    local_expert: torch.Tensor
    slot: torch.Tensor
    counts: list[int]
    num_tokens: int
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int


class Buffer:
    """Elastic EP communication buffer over a kvplane process group.

    Args:
        group: a :class:`~kvplane.collectives.KvplaneProcessGroup` (None: the default group).
        num_nvl_bytes: accepted for DeepEP compatibility; unused on CPU.
        num_rdma_bytes: accepted for DeepEP compatibility; unused on CPU.
        low_latency_mode: accepted for DeepEP compatibility; both modes always work.
        **kwargs: other DeepEP constructor options, accepted and ignored.

    Raises:
        InvalidArgument: the group is not a kvplane group.
    """

    def __init__(self, group: Any = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, **kwargs: Any) -> None:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        if not isinstance(pg, KvplaneProcessGroup):
            raise InvalidArgument("kvplane.ep.Buffer needs a kvplane process group")
        self.group = pg
        self.rank = pg.rank()
        self.group_size = pg.size()
        self.low_latency_mode = low_latency_mode

    def _active(self, active_ranks: torch.Tensor | None) -> torch.Tensor:
        if active_ranks is None:
            return self.group.active_ranks.clone()
        if active_ranks.shape != (self.group_size,):
            raise InvalidArgument(f"active_ranks must have shape [{self.group_size}]")
        return active_ranks

    # ------------------------------------------------------------------ normal mode
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: Any = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False,
                            *, active_ranks: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, None, torch.Tensor, torch.Tensor, None]:
        """``(num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank, None)`` (local)."""
        lay = topology.dispatch_layout(topk_idx, num_experts, self.group_size, active_ranks)
        return lay.num_tokens_per_rank, None, lay.num_tokens_per_expert, lay.is_token_in_rank, None

    def dispatch(self, x: torch.Tensor, handle: DispatchHandle | None = None,
                 num_tokens_per_rank: torch.Tensor | None = None,
                 num_tokens_per_rdma_rank: Any = None,
                 is_token_in_rank: torch.Tensor | None = None,
                 num_tokens_per_expert: torch.Tensor | None = None,
                 topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Any = None,
                 previous_event: Any = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False,
                 *, active_ranks: torch.Tensor | None = None, timeout_us: int = -1
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], DispatchHandle, None]:
        """Send each token once to every rank owning one of its experts.

        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
            None)``; ``recv_topk_idx`` holds local expert ids (``-1`` for experts elsewhere).
        """
        if topk_idx is None or topk_weights is None:
            raise InvalidArgument("this implementation needs topk_idx and topk_weights")
        act = self._active(active_ranks)
        num_experts = int(num_tokens_per_expert.numel()) if num_tokens_per_expert is not None else None
        if num_experts is None:
            raise InvalidArgument("pass num_tokens_per_expert from get_dispatch_layout")
        if is_token_in_rank is None:
            layout = topology.dispatch_layout(topk_idx, num_experts, self.group_size, act)
            is_token_in_rank = layout.is_token_in_rank
        tokens = torch.arange(x.shape[0])
        rows, meta = [], []
        for r in range(self.group_size):
            sel = is_token_in_rank[:, r] & bool(act[r])
            rows.append(torch.cat([x[sel], topk_weights[sel].to(x.dtype)], dim=1))
            meta.append(torch.cat([tokens[sel].unsqueeze(1), topk_idx[sel]], dim=1))
        ex = exchange(self.group, rows, meta, act, timeout_us)
        hidden, k = x.shape[1], topk_idx.shape[1]
        local = topology.experts_per_rank(num_experts, self.group_size)
        first = self.rank * local
        gidx = ex.meta[:, 1:]
        mine = (gidx >= first) & (gidx < first + local)
        recv_idx = torch.where(mine, gidx - first, -1)
        recv_w = torch.where(mine, ex.rows[:, hidden:hidden + k].to(topk_weights.dtype), 0)
        per_expert = [int((recv_idx == e).sum()) for e in range(local)]
        handle = DispatchHandle(ex.meta[:, 0].clone(), ex.counts, x.shape[0])
        return ex.rows[:, :hidden].contiguous(), recv_idx, recv_w, per_expert, handle, None

    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None = None,
                bias: Any = None, config: Any = None, previous_event: Any = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False, *, active_ranks: torch.Tensor | None = None,
                timeout_us: int = -1) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        """Send expert outputs back and sum them per source token (no weighting).

        Returns:
            ``(combined_x [num_tokens, hidden], combined_topk_weights | None, None)``.
        """
        act = self._active(active_ranks)
        offs = [0]
        for c in handle.counts:
            offs.append(offs[-1] + c)
        rows = [x[offs[r]:offs[r + 1]] for r in range(self.group_size)]
        meta = [handle.src_token[offs[r]:offs[r + 1]].unsqueeze(1) for r in range(self.group_size)]
        ex = exchange(self.group, rows, meta, act, timeout_us)
        out = torch.zeros(handle.num_tokens, x.shape[1], dtype=x.dtype)
        valid = ex.meta[:, 0] >= 0
        out.index_add_(0, ex.meta[valid, 0], ex.rows[valid])
        return out, topk_weights, None

    # ------------------------------------------------------------------ low-latency mode
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Any = None,
                             dispatch_wait_recv_cost_stats: Any = None, use_fp8: bool = False,
                             round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False,
                             return_recv_hook: bool = False, *, active_ranks: torch.Tensor | None = None,
                             timeout_us: int = -1
                             ) -> tuple[torch.Tensor, torch.Tensor, LowLatencyHandle, None, None]:
        """Send every (token, expert) pair to the expert's owner.

        Returns:
            ``(recv_x [local_experts, num_ranks * max_tokens, hidden], recv_count [local_experts]
            int32, handle, None, None)``. Rows of a local expert are packed in source-rank order.

        Raises:
            InvalidArgument: ``use_fp8`` (not supported on CPU) or too many tokens.
        """
        if use_fp8:
            raise InvalidArgument("use_fp8 is not supported by the CPU implementation")
        if x.shape[0] > num_max_dispatch_tokens_per_rank:
            raise InvalidArgument("more tokens than num_max_dispatch_tokens_per_rank")
        act = self._active(active_ranks)
        own = topology.owner(topk_idx, num_experts, self.group_size)
        local = topology.experts_per_rank(num_experts, self.group_size)
        tok = torch.arange(x.shape[0]).unsqueeze(1).expand_as(topk_idx)
        rows, meta = [], []
        for r in range(self.group_size):
            sel = (own == r) & bool(act[r])
            rows.append(x[tok[sel]])
            meta.append(torch.stack([tok[sel], topk_idx[sel] - r * local], dim=1))
        ex = exchange(self.group, rows, meta, act, timeout_us)
        src_tok, lexp = ex.meta[:, 0], ex.meta[:, 1]
        hidden = x.shape[1]
        recv_x = torch.zeros(local, self.group_size * num_max_dispatch_tokens_per_rank, hidden, dtype=x.dtype)
        slot = torch.zeros_like(src_tok)
        count = torch.zeros(local, dtype=torch.int32)
        for i in range(src_tok.shape[0]):  # source-rank order is preserved by the exchange
            e = int(lexp[i])
            if e < 0:
                continue
            slot[i] = count[e]
            recv_x[e, int(count[e])] = ex.rows[i]
            count[e] += 1
        handle = LowLatencyHandle(src_tok, lexp, slot, ex.counts, x.shape[0],
                                  num_max_dispatch_tokens_per_rank, hidden, num_experts)
        return recv_x, count, handle, None, None

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats: Any = None, *,
                            active_ranks: torch.Tensor | None = None,
                            timeout_us: int = -1) -> tuple[torch.Tensor, None, None]:
        """Return expert outputs to their tokens and sum them weighted by ``topk_weights``.

        Experts whose owner is inactive (or fails now) contribute nothing; weights are not
        renormalised.

        Returns:
            ``(combined_x [num_tokens, hidden], None, None)``.
        """
        act = self._active(active_ranks)
        valid = handle.local_expert >= 0
        vals = torch.zeros(handle.src_token.shape[0], handle.hidden, dtype=x.dtype)
        vals[valid] = x[handle.local_expert[valid], handle.slot[valid]]
        offs = [0]
        for c in handle.counts:
            offs.append(offs[-1] + c)
        per_rank = handle.num_experts // self.group_size
        gexp = torch.where(valid, handle.local_expert + self.rank * per_rank, -1)
        rows = [vals[offs[r]:offs[r + 1]] for r in range(self.group_size)]
        meta = [torch.stack([handle.src_token[offs[r]:offs[r + 1]], gexp[offs[r]:offs[r + 1]]], dim=1)
                for r in range(self.group_size)]
        ex = exchange(self.group, rows, meta, act, timeout_us)
        result = torch.zeros(handle.num_tokens, handle.hidden, dtype=x.dtype) if out is None else out.zero_()
        for i in range(ex.meta.shape[0]):
            t, e = int(ex.meta[i, 0]), int(ex.meta[i, 1])
            if t < 0 or e < 0:
                continue
            k = (topk_idx[t] == e).nonzero()
            if k.numel():
                result[t] += topk_weights[t, int(k[0])].to(x.dtype) * ex.rows[i]
        return result, None, None

    def get_ep_buffer_size_hint(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                num_experts: int) -> int:
        """Bytes a GPU implementation would reserve; informational on CPU."""
        return num_max_dispatch_tokens_per_rank * hidden * num_experts * 2 * 2

    def update_ep_member(self) -> None:
        """Refresh after a membership change (nothing to refresh on CPU)."""
