"""Which chunk a receiver fetches next, and from which holder: the pure choice.

Two strategies, measured against each other in ``benchmarks/p2p.py``:

- ``rarest``: chunk first. Take the missing chunk that the fewest holders have (ties broken at
  random), then its least-loaded holder. New chunks leave the publisher once and spread from
  the receivers, as in BitTorrent's rarest-first.
- ``least-loaded``: holder first. Take the holder with the fewest uploads in flight, then a
  random missing chunk it has.

A third, ``publisher``, is the baseline they are measured against: every receiver fetches from
the publisher alone, with no limit on its uploads.

Either way a holder never serves more than ``max_uploads`` fetches at once, and at equal load a
replica is preferred over the publisher ("gold"), as Mooncake's P2P store does, to keep the
publisher's link for chunks nobody else has. Pure: no I/O, threads or clocks; randomness
comes from the caller's seeded ``random.Random``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Mapping, Sequence

from kvplane.common.errors import InvalidArgument

STRATEGIES = ("rarest", "least-loaded", "publisher")
Assignment = tuple[int, str, int]  # (chunk, holder, remote address)
Holders = Sequence[Mapping[str, int]]
Usable = Callable[[int, str], bool]
Rank = Callable[[str], tuple[int, bool, float]]


def choose(missing: Sequence[int], holders: Holders, load: dict[str, int],
           want: int, *, strategy: str = "rarest", gold: Collection[str] = (),
           usable: Collection[str] | None = None, banned: Collection[tuple[int, str]] = (),
           max_uploads: int = 4, pending: Mapping[int, int] | None = None,
           rng: random.Random | None = None) -> list[Assignment]:
    """Pick up to ``want`` (chunk, holder, address) fetches.

    Args:
        missing: chunks the receiver has neither got nor in flight.
        holders: per chunk, holder -> address of that chunk in the holder's memory.
        load: holder -> fetches it serves now; updated in place for the returned picks.
        want: most fetches to return.
        strategy: ``rarest``, ``least-loaded`` or ``publisher``.
        gold: the publishers (used last at equal load).
        usable: holders that may be chosen (None: all).
        banned: (chunk, holder) pairs this receiver must not use again.
        max_uploads: most fetches one holder serves at once.
        pending: chunk -> fetches of it in flight to other receivers (they count toward its
            rarity: a chunk already on its way somewhere is not the rarest).
        rng: tie-breaker.

    Raises:
        InvalidArgument: unknown strategy.
    """
    if strategy not in STRATEGIES:
        raise InvalidArgument(f"strategy {strategy!r}: choose one of {STRATEGIES}")
    rng = rng or random.Random(0)
    if strategy == "publisher":
        usable, max_uploads = set(gold) & set(usable if usable is not None else gold), 1 << 30
    ban = set(banned)

    def ok(c: int, h: str) -> bool:
        return (usable is None or h in usable) and (c, h) not in ban

    def rank(h: str) -> tuple[int, bool, float]:
        return load.get(h, 0), h in gold, rng.random()

    if strategy in ("rarest", "publisher"):
        return _rarest(missing, holders, load, want, ok, rank, max_uploads, pending or {}, rng)
    return _least_loaded(missing, holders, load, want, ok, rank, max_uploads, rng)


def _rarest(missing: Sequence[int], holders: Holders, load: dict[str, int], want: int, ok: Usable,
            rank: Rank, max_uploads: int, pending: Mapping[int, int],
            rng: random.Random) -> list[Assignment]:
    order = sorted(missing, key=lambda c: (sum(ok(c, h) for h in holders[c]) + pending.get(c, 0),
                                           rng.random()))
    out: list[Assignment] = []
    for c in order:
        if len(out) >= want:
            break
        free = [h for h in holders[c] if ok(c, h) and load.get(h, 0) < max_uploads]
        if not free:
            continue
        h = min(free, key=rank)
        load[h] = load.get(h, 0) + 1
        out.append((c, h, holders[c][h]))
    return out


def _least_loaded(missing: Sequence[int], holders: Holders, load: dict[str, int], want: int,
                  ok: Usable, rank: Rank, max_uploads: int,
                  rng: random.Random) -> list[Assignment]:
    left = list(missing)
    rng.shuffle(left)
    by_holder: dict[str, list[int]] = {}
    for c in left:
        for h in holders[c]:
            if ok(c, h):
                by_holder.setdefault(h, []).append(c)
    out: list[Assignment] = []
    taken: set[int] = set()
    while len(out) < want:
        cands = [h for h, cs in by_holder.items() if load.get(h, 0) < max_uploads
                 and any(c not in taken for c in cs)]
        if not cands:
            break
        h = min(cands, key=rank)
        c = next(c for c in by_holder[h] if c not in taken)
        taken.add(c)
        load[h] = load.get(h, 0) + 1
        out.append((c, h, holders[c][h]))
    return out


def unavailable(missing: Sequence[int], holders: Holders,
                alive: Collection[str]) -> list[int]:
    """Missing chunks that no live holder has at all (the fetch cannot finish)."""
    return [c for c in missing if not any(h in alive for h in holders[c])]
