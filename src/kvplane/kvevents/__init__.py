"""vLLM's KV-cache events: one schema, its codec, and a ZMQ publisher.

The store (pool events) and the conductor (ingest) both depend on this package; neither depends
on the other. Importing it does not import zmq: the publisher lives in
``kvplane.kvevents.publisher`` and is imported by name when needed.
"""

from kvplane.kvevents.codec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    cleared,
    decode_batch,
    decode_seq,
    encode_batch,
    extra_keys_of,
    removed,
    stored,
    to_event_hash,
    tokens_of,
)
from kvplane.kvevents.schema import Tier, tier_of

__all__ = [
    "AllBlocksCleared", "BlockRemoved", "BlockStored", "Event", "EventBatch", "Tier", "cleared",
    "decode_batch", "decode_seq", "encode_batch", "extra_keys_of", "removed", "stored",
    "tier_of", "to_event_hash", "tokens_of",
]
