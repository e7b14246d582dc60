"""PrefixIndex.match against a plain reference implementation, over seeded random scenarios.

The index walks every cursor at once with bitmasks; the reference walks one (instance, rank)
at a time with sets, straight from the semantics in indexer.py's docstring: GPU prefix of the
rank, then on through what the instance (any rank) or a shared holder has on CPU, then on DISK.
"""

from __future__ import annotations

import random

import pytest

from kvplane.conductor import indexer
from kvplane.conductor.hashing import HashStream
from kvplane.conductor.indexer import ContextKey, Holder, PrefixIndex, Tier
from kvplane.testing.needs import requires

pytestmark = pytest.mark.timeout(30)
CTX = ContextKey("t", "m", "", 16, "")
SHARED = "pool"


def run_while(chain: list[int], start: int, held: set[int]) -> int:
    i = start
    while i < len(chain) and chain[i] in held:
        i += 1
    return i


def reference(holdings: dict[Holder, set[int]], chain: list[int], instance: str,
              rank: int) -> tuple[int, int, int]:
    def union(tier: Tier, owners: set[str]) -> set[int]:
        return set().union(*(blocks for h, blocks in holdings.items()
                             if h.tier == tier and h.instance in owners))

    gpu = run_while(chain, 0, holdings.get(Holder(instance, rank, Tier.GPU), set()))
    cpu = run_while(chain, gpu, union(Tier.CPU, {instance, SHARED}))
    disk = run_while(chain, cpu, union(Tier.DISK, {instance, SHARED}))
    return gpu, cpu, disk


def scenario(rng: random.Random) -> tuple[dict[Holder, set[int]], list[int]]:
    chain = [rng.getrandbits(64) for _ in range(rng.randint(0, 12))]
    pool = chain + [rng.getrandbits(64) for _ in range(4)]
    holdings: dict[Holder, set[int]] = {}
    for instance in ["a", "b", "c", SHARED][:rng.randint(1, 4)]:
        for rank in range(rng.randint(1, 3)):
            for tier in Tier:
                if rng.random() < 0.6:
                    prefix = chain[:rng.randint(0, len(chain))]
                    holdings[Holder(instance, rank, tier)] = set(prefix) | set(rng.sample(pool, 3))
    return holdings, chain


def _as(form: str, chain: list[int], rng: random.Random):
    """The chain as the walk may get it: pulled one by one, a list, or a batched hash stream."""
    if form == "iter":
        return iter(chain)
    if form == "stream":
        cut = rng.randint(0, len(chain))
        return HashStream(iter([chain[:cut], chain[cut:]]))
    return list(chain)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("form", ["iter", "list", "list-python", "stream", "wide"])
def test_match_agrees_with_the_reference(seed, form, monkeypatch):
    """Every input form, with the C walk (when built) and without (``list-python``); ``wide``
    adds holders until masks pass 64 bits, where the C walk hands back to Python."""
    if form == "list-python":
        monkeypatch.setattr(indexer, "native", None)
    rng = random.Random(seed)
    for _ in range(100):
        holdings, chain = scenario(rng)
        if form == "wide":
            for k in range(70):  # 70 slots and more: masks past 64 bits
                holdings[Holder(f"filler{k}", 0, Tier(k % 3))] = set(rng.sample(chain, len(chain) // 2))
        index = PrefixIndex()
        for holder, blocks in holdings.items():
            index.store(CTX, holder, blocks)
        asked = {h.instance: set() for h in holdings if h.instance != SHARED}
        for h in holdings:
            if h.instance != SHARED:
                asked[h.instance].add(h.dp_rank)
        asked["idle"] = {0, 1}  # holds nothing: may only profit from the shared pool
        got = index.match(CTX, _as(form, chain, rng), asked, shared=[SHARED])
        for instance, ranks in asked.items():
            per_rank = {r: reference(holdings, chain, instance, r) for r in ranks}
            match = got[instance]
            assert match.dp == {r: g for r, (g, _, _) in per_rank.items()}, (seed, instance)
            assert match.gpu == max(g for g, _, _ in per_rank.values())
            assert match.cpu == max(c for _, c, _ in per_rank.values())
            assert match.disk == match.longest == max(d for _, _, d in per_rank.values())


def test_the_c_walk_is_built_and_used(monkeypatch):
    """Guard against the C path silently not running (then only the Python walk is tested)."""
    requires("accel")
    calls = []
    real = indexer.native.continue_run

    class Spy:
        @staticmethod
        def continue_run(*args):
            calls.append(args[2])
            return real(*args)
    monkeypatch.setattr(indexer, "native", Spy)
    index = PrefixIndex()
    chain = list(range(1, 200))
    index.store(CTX, Holder("a", 0, Tier.GPU), chain[:50])
    assert index.match(CTX, chain, {"a": {0}})["a"].gpu == 50
    assert calls and calls[0] == 0
