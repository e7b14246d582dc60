"""Sharded metadata: the key space split among several master shards (docs/store.md,
"Sharded metadata").

``slots`` (hash slots, the shard map) and ``shares`` (a segment's space per shard) are pure;
``role`` and ``move_rpc`` are what a master does as a shard; ``link``, ``session`` and
``host`` are the client's side (routing, mounting a share with every shard); ``mover`` moves
slots and adds or removes shards; ``launch`` runs shards as processes; ``status`` joins the
shards' status documents. Clients need none of it by name: ``StoreClient`` finds out that its
master is a shard.
"""

from kvplane.store.shard.slots import SLOTS, ShardInfo, ShardMap, slot_of

__all__ = ["SLOTS", "ShardInfo", "ShardMap", "slot_of"]
