"""Communication schedules: which block goes to which ring position at each step.

Pure: positions are indices into the sorted list of participating ranks, nothing here touches
sockets, clocks or tensors. The ops in :mod:`kvplane.collectives.ops` walk these schedules.

Ring reduce-scatter (n positions, n blocks): at step ``s`` position ``i`` sends its partial sum of
block ``(i - s - 1) % n`` to position ``i + 1`` and receives block ``(i - s - 2) % n`` from
``i - 1``. After ``n - 1`` steps position ``i`` holds block ``i`` reduced over everyone, in the
fixed order given by :func:`reduction_order`. Ring allgather then circulates the blocks.
"""

from __future__ import annotations


def split(numel: int, n: int) -> list[tuple[int, int]]:
    """Split ``numel`` elements into ``n`` contiguous blocks (the first ``numel % n`` one longer).

    Returns:
        ``[(start, stop), ...]`` of length ``n``.
    """
    if n <= 0:
        raise ValueError("n must be positive")
    base, extra = divmod(numel, n)
    out = []
    start = 0
    for b in range(n):
        stop = start + base + (1 if b < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def ring_reduce_scatter(i: int, n: int) -> list[tuple[int, int]]:
    """The ``(send_block, recv_block)`` pairs of position ``i`` for the ``n - 1`` steps."""
    return [((i - s - 1) % n, (i - s - 2) % n) for s in range(n - 1)]


def ring_allgather(i: int, n: int) -> list[tuple[int, int]]:
    """The ``(send_block, recv_block)`` pairs of position ``i`` when position ``p`` starts with
    block ``p``."""
    return [((i - s) % n, (i - s - 1) % n) for s in range(n - 1)]


def reduction_order(block: int, n: int) -> list[int]:
    """Positions in the order their inputs are folded into ``block`` by the ring reduce-scatter.

    The result of block ``b`` is ``((x[o0] op x[o1]) op x[o2]) ...`` for ``o = reduction_order(b, n)``.
    """
    return [(block + 1 + k) % n for k in range(n)]


def tree_broadcast(v: int, n: int) -> list[tuple[int, str, int]]:
    """Binomial-tree broadcast from relative position 0.

    Args:
        v: this rank's position relative to the root (``(i - root) % n``).
        n: number of positions.

    Returns:
        ``(level, action, peer)`` in order, action ``"recv"`` or ``"send"``, peer relative to the
        root. Sender and receiver of one edge agree on its level.
    """
    out: list[tuple[int, str, int]] = []
    d, level = 1, 0
    while d < n:
        if v < d and v + d < n:
            out.append((level, "send", v + d))
        elif d <= v < 2 * d:
            out.append((level, "recv", v - d))
        d *= 2
        level += 1
    return out


def pairwise(i: int, n: int) -> list[tuple[int, int]]:
    """All-to-all exchange partners of position ``i``: ``(send_to, recv_from)`` for steps 1..n-1."""
    return [((i + s) % n, (i - s) % n) for s in range(1, n)]
