"""Thin adapters from the conductor's prefix index to the policies' :class:`PrefixSource`.

``IndexPrefixes`` drives a :class:`~kvplane.conductor.indexer.PrefixIndex` directly (the
simulator feeds it what its caches store and evict, as KV events would); ``ConductorPrefixes``
asks a running :class:`~kvplane.conductor.service.Conductor` (the live router). Both answer with
the index's own ``match``; no private copy of the matching logic lives here.

Tier mapping: an instance's device cache is ``Tier.GPU``, its DRAM ``Tier.CPU``; the shared pool is
one *shared* holder on ``Tier.DISK`` so that ``Match.cpu`` stays instance-local (device, then own
DRAM) and ``Match.longest`` adds the pool. Must not import the simulator.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvplane.common.errors import KVPlaneError
from kvplane.conductor.indexer import ContextKey, Holder, Match, PrefixIndex
from kvplane.conductor.service import Conductor, QueryRequest
from kvplane.kvevents import Tier

POOL = "pool"
TRACE_CONTEXT = ContextKey(model="trace", block_size=512)


class IndexPrefixes:
    """Prefix source over an in-process :class:`PrefixIndex`, with batched updates.

    Args:
        index: the conductor's index (shared, or a fresh one for a simulation).
        instances: prefill instance ids (each reported with DP rank 0).
        ctx: the context the trace hashes live in (trace hash_ids are used as block hashes).
        pool: whether the shared pool holder takes part in matches.
    """

    def __init__(self, index: PrefixIndex, instances: Sequence[str],
                 ctx: ContextKey = TRACE_CONTEXT, pool: bool = False) -> None:
        self.index, self.ctx = index, ctx
        self._instances: dict[str, tuple[int, ...]] = {i: (0,) for i in instances}
        self._shared = (POOL,) if pool else ()
        self._holders: dict[tuple[str, Tier], Holder] = {}
        self.calls = 0

    def holder(self, instance: str, tier: Tier) -> Holder:
        """The (cached) index holder of an instance's tier."""
        key = (instance, tier)
        h = self._holders.get(key)
        if h is None:
            h = self._holders[key] = Holder(instance, 0, tier)
        return h

    def store(self, instance: str, tier: Tier, hashes: Iterable[int]) -> None:
        """Record blocks newly held (one index call per batch, like one BlockStored event)."""
        self.index.store(self.ctx, self.holder(instance, tier), hashes)

    def remove(self, instance: str, tier: Tier, hashes: Iterable[int]) -> None:
        """Record evicted blocks (one index call per batch, like one BlockRemoved event)."""
        self.index.remove(self.ctx, self.holder(instance, tier), hashes)

    def match(self, hash_ids: Sequence[int]) -> dict[str, Match]:
        """Per prefill instance: ``gpu``/``cpu`` local prefix, ``longest`` including the pool."""
        self.calls += 1
        return self.index.match(self.ctx, hash_ids, self._instances, self._shared)

    def match_one(self, instance: str, hash_ids: Sequence[int]) -> Match:
        """Match for one instance only (cheaper; used for queue bookkeeping)."""
        self.calls += 1
        return self.index.match(self.ctx, hash_ids, {instance: (0,)}, self._shared)[instance]


class ConductorPrefixes:
    """Prefix source over a live :class:`Conductor` (``/query_by_hash`` semantics, in process).

    Args:
        conductor: the running conductor whose engines publish KV events.
        model: served model name the instances registered with.
        block_size: tokens per block of those engines.
        instances: prefill instance ids to report (others registered for the model are ignored).
        tenant_id: tenant of the instances.
    """

    def __init__(self, conductor: Conductor, model: str, block_size: int,
                 instances: Sequence[str], tenant_id: str = "default") -> None:
        self.conductor, self.model, self.block_size = conductor, model, block_size
        self.instances, self.tenant_id = list(instances), tenant_id
        self.errors = 0

    def match(self, hash_ids: Sequence[int]) -> dict[str, Match]:
        """Ask the conductor; instances it does not know get zero matches.

        A conductor error counts in ``errors`` and is a miss (the cache path degrades rather
        than failing the routing decision).
        """
        try:
            got = self.conductor.match(QueryRequest(self.model, seq_hashes=list(hash_ids),
                                                    tenant_id=self.tenant_id,
                                                    block_size=self.block_size))
        except KVPlaneError:
            self.errors += 1
            got = {}
        return {i: got.get(i, Match()) for i in self.instances}
