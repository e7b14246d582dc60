"""Expert placement and dispatch layouts for elastic expert parallelism (pure: torch ops only).

Experts are split contiguously: rank ``r`` owns experts ``[r * L, (r + 1) * L)`` with
``L = num_experts // num_ranks``. ``topk_idx`` entries of ``-1`` mean "no expert". An inactive
rank's experts are dropped: their slots contribute nothing and the remaining top-k weights are not
renormalised (Mooncake EP's behaviour). No communication here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvplane.common.errors import InvalidArgument


def experts_per_rank(num_experts: int, num_ranks: int) -> int:
    """Experts owned by each rank.

    Raises:
        InvalidArgument: ``num_experts`` is not a positive multiple of ``num_ranks``.
    """
    if num_experts <= 0 or num_experts % num_ranks:
        raise InvalidArgument(f"num_experts={num_experts} must be a positive multiple of {num_ranks} ranks")
    return num_experts // num_ranks


def owner(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """Owning rank of every ``topk_idx`` entry (``-1`` stays ``-1``)."""
    local = experts_per_rank(num_experts, num_ranks)
    if topk_idx.numel() and (topk_idx.max() >= num_experts or topk_idx.min() < -1):
        raise InvalidArgument(f"topk_idx entries must be in [-1, {num_experts})")
    return torch.where(topk_idx >= 0, torch.div(topk_idx, local, rounding_mode="floor"), -1)


@dataclass(frozen=True)
class Layout:
    """Where a rank's tokens go.

    Attributes:
        num_tokens_per_rank: int32 ``[num_ranks]`` tokens sent to each rank.
        num_tokens_per_expert: int32 ``[num_experts]`` (token, expert) pairs per expert.
        is_token_in_rank: bool ``[num_tokens, num_ranks]``.
    """

    num_tokens_per_rank: torch.Tensor
    num_tokens_per_expert: torch.Tensor
    is_token_in_rank: torch.Tensor


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int,
                    active: torch.Tensor | None = None) -> Layout:
    """Compute the dispatch layout of ``topk_idx`` (``[num_tokens, k]``, int64).

    Args:
        topk_idx: selected experts per token.
        num_experts: total experts.
        num_ranks: ranks in the group.
        active: optional int32 ``[num_ranks]`` mask; experts of inactive ranks are dropped.
    """
    own = owner(topk_idx, num_experts, num_ranks)
    if active is not None:
        own = torch.where((own >= 0) & (active.to(torch.bool)[own.clamp(min=0)]), own, -1)
    tokens = topk_idx.shape[0]
    in_rank = torch.zeros(tokens, num_ranks, dtype=torch.bool)
    for k in range(topk_idx.shape[1]):
        col = own[:, k]
        sel = col >= 0
        in_rank[sel.nonzero().squeeze(1), col[sel]] = True
    valid = topk_idx[own >= 0]
    per_expert = torch.bincount(valid, minlength=num_experts).to(torch.int32)
    return Layout(in_rank.sum(0).to(torch.int32), per_expert, in_rank)
