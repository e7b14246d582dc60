"""Store keys of LMCache chunks (pure: imports neither LMCache nor torch).

A chunk's key is LMCache's own ``CacheEngineKey.to_string()`` (model, world size, worker id,
chunk hash, dtype and request tags, all kept), in kvplane's ``lmcache/`` namespace, followed by
the chunk's KV-event hash::

    lmcache/{model}@{world size}@{worker id}@{chunk hash hex}@{dtype}[@tags]/0x{event hash}

The store master publishes the last component (``BlockStored``/``BlockRemoved``, medium CPU), so
a conductor sees which chunks sit in the pool under the hash LMCache's own KV events use for a
chunk: its ``chunk_hash`` as u64 (a digest projects to its last 8 bytes, as in vLLM's events).
"""

from __future__ import annotations

from kvplane.kvevents.codec import to_event_hash

NAMESPACE = "lmcache/"


def event_hash(chunk_hash: int | bytes) -> int:
    """The u64 KV-event hash of a chunk hash."""
    return to_event_hash(chunk_hash)


def store_key(key_string: str, chunk_hash: int | bytes) -> str:
    """The store key of the chunk whose ``CacheEngineKey.to_string()`` is ``key_string``."""
    return f"{NAMESPACE}{key_string}/{event_hash(chunk_hash):#018x}"


def key_string(store_key_: str) -> str:
    """The ``CacheEngineKey.to_string()`` inside a store key (inverse of :func:`store_key`).

    Raises:
        ValueError: not a key of this namespace.
    """
    if not store_key_.startswith(NAMESPACE) or "/0x" not in store_key_:
        raise ValueError(f"not an LMCache chunk key: {store_key_!r}")
    return store_key_[len(NAMESPACE):].rsplit("/", 1)[0]


def leading(found: list[bool]) -> int:
    """How many entries from the start are True."""
    return found.index(False) if False in found else len(found)
