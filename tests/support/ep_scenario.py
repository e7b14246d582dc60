"""A small elastic-EP scenario shared by tests and users: inputs, experts, reference, one round.

Four ranks, eight experts, top-3 routing; ``run_round`` does normal and low-latency
dispatch -> expert -> combine and returns both results; ``reference`` computes the expected output
in one process, dropping the experts of dead ranks without renormalising.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

import kvplane.collectives as kc
from kvplane.ep import Buffer
from tests.support.ranks import RankContext

WORLD, EXPERTS, TOPK, HIDDEN, TOKENS = 4, 8, 3, 8, 6
LOCAL = EXPERTS // WORLD
TIMEOUT_US = 3_000_000


def inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded ``(x, topk_idx, topk_weights)`` of ``rank`` (token 0 has an empty slot)."""
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g)
    idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(TOKENS)])
    idx[0, -1] = -1  # a token with an empty slot
    w = torch.rand(TOKENS, TOPK, generator=g)
    return x, idx, w


def expert(e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e``'s function (affine, distinct per expert)."""
    return x * (e + 1) + 0.5 * e


def reference(rank: int, dead: set[int]) -> torch.Tensor:
    """Single-process expected output of ``rank``'s tokens with the experts of ``dead`` dropped."""
    x, idx, w = inputs(rank)
    out = torch.zeros_like(x)
    for t in range(TOKENS):
        for k in range(TOPK):
            e = int(idx[t, k])
            if e >= 0 and e // LOCAL not in dead:
                out[t] += w[t, k] * expert(e, x[t])
    return out


def run_round(buf: Buffer, rank: int, active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Normal and low-latency dispatch -> experts -> combine; returns both combined outputs."""
    x, idx, w = inputs(rank)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, EXPERTS, active_ranks=active)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=w, active_ranks=active, timeout_us=TIMEOUT_US)
    y = torch.zeros_like(recv_x)
    for le in range(LOCAL):
        sel = recv_idx == le
        rows = sel.any(1)
        wk = (recv_w * sel).sum(1, keepdim=True)
        y[rows] += wk[rows] * expert(rank * LOCAL + le, recv_x[rows])
    assert sum(counts) == int((recv_idx >= 0).sum())
    normal, _, _ = buf.combine(y, handle, active_ranks=active, timeout_us=TIMEOUT_US)
    rx, rcount, h2, _, _ = buf.low_latency_dispatch(x, idx, TOKENS, EXPERTS, active_ranks=active,
                                                    timeout_us=TIMEOUT_US)
    out = torch.zeros_like(rx)
    for le in range(LOCAL):
        n = int(rcount[le])
        out[le, :n] = expert(rank * LOCAL + le, rx[le, :n])
    ll, _, _ = buf.low_latency_combine(out, idx, w, h2, active_ranks=active, timeout_us=TIMEOUT_US)
    return normal, ll


def worker(ctx: RankContext, kill: bool) -> dict[str, object]:
    """RankGroup worker: one round; with ``kill``, rank 2 dies and the survivors run another."""
    dist.init_process_group("kvplane", store=ctx.store, rank=ctx.rank, world_size=ctx.world_size,
                            pg_options=kc.KvplaneOptions(timeout=5.0, heartbeat_timeout=1.0))
    buf = Buffer(dist.group.WORLD)
    active = torch.ones(WORLD, dtype=torch.int32)
    res: dict[str, object] = {"first": run_round(buf, ctx.rank, active)}
    if kill:
        if ctx.rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        res["second"] = run_round(buf, ctx.rank, active)
        res["seconds"] = time.monotonic() - t0
        res["active"] = active.tolist()
    return res
