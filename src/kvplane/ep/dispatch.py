"""Row exchange for EP dispatch/combine over a kvplane process group, with a per-op deadline.

One call moves, for every destination rank, a block of rows (tokens) plus their int64 metadata,
using the group's all-to-all with ``timeout_us`` as the op deadline. Ranks that did not take part
(dead, hung, or already inactive) are cleared in the caller's ``active_ranks`` and contribute zero
rows. CPU reference implementation: correctness and failure semantics, not speed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvplane.collectives import KvplaneProcessGroup, KvplaneWork


@dataclass
class Exchanged:
    """Rows received from every source rank, in source-rank order.

    Attributes:
        rows: ``[sum(counts), ...]`` received rows.
        meta: ``[sum(counts), m]`` int64 metadata rows.
        counts: rows received from each source rank.
    """

    rows: torch.Tensor
    meta: torch.Tensor
    counts: list[int]


def _opts(timeout_us: int) -> dist.AllToAllOptions:
    o = dist.AllToAllOptions()
    if timeout_us > 0:
        o.timeout = timedelta(microseconds=timeout_us)
    return o


def _note(work: KvplaneWork, active: torch.Tensor) -> None:
    work.wait()
    failed = work.failed_ranks_hint
    active.masked_fill_(failed.to(torch.bool), 0)


def exchange(pg: KvplaneProcessGroup, rows: list[torch.Tensor], meta: list[torch.Tensor],
             active: torch.Tensor, timeout_us: int) -> Exchanged:
    """Send ``rows[r]``/``meta[r]`` to rank ``r`` and receive everyone's blocks for this rank.

    Args:
        pg: the kvplane group.
        rows: per destination rank, ``[n_r, *row_shape]`` (same dtype and row shape for all).
        meta: per destination rank, ``[n_r, m]`` int64.
        active: int32 ``[num_ranks]``, updated in place: ranks that missed the deadline become 0.
            Blocks to or from ranks already 0 are empty.
        timeout_us: per-op deadline in microseconds (``-1``: the group default).
    """
    n = pg.size()
    me = pg.rank()
    alive = [bool(active[r]) or r == me for r in range(n)]
    rows = [x if alive[r] else x[:0] for r, x in enumerate(rows)]
    meta = [m if alive[r] else m[:0] for r, m in enumerate(meta)]
    send_counts = torch.tensor([x.shape[0] for x in rows], dtype=torch.int64)
    recv_counts = torch.zeros(n, dtype=torch.int64)
    work = pg.all_to_all_single(recv_counts, send_counts, [], [], _opts(timeout_us))
    _note(work, active)
    counts = [int(recv_counts[r]) if (bool(active[r]) or r == me) else 0 for r in range(n)]
    row_shape = rows[0].shape[1:]
    out_rows = torch.zeros((sum(counts), *row_shape), dtype=rows[0].dtype)
    send_rows = torch.cat(rows).contiguous()
    w1 = pg.all_to_all_single(out_rows, send_rows, counts, [x.shape[0] for x in rows], _opts(timeout_us))
    m = meta[0].shape[1]
    out_meta = torch.full((sum(counts), m), -1, dtype=torch.int64)
    w2 = pg.all_to_all_single(out_meta, torch.cat(meta).contiguous(), counts, [x.shape[0] for x in meta],
                              _opts(timeout_us))
    _note(w1, active)
    _note(w2, active)
    # a source that failed after announcing its count contributes nothing
    keep = torch.cat([torch.full((c,), bool(active[r]) or r == me) for r, c in enumerate(counts)]) \
        if counts else torch.zeros(0, dtype=torch.bool)
    out_rows[~keep] = 0
    out_meta[~keep] = -1
    return Exchanged(out_rows, out_meta, counts)
