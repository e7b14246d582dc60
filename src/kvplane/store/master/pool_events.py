"""The store's KV events: BlockStored / BlockRemoved in vLLM's wire format, medium "CPU".

A conductor registers the store as a shared pool (``"type": "kvplane"``), so a prefix held in
the pool counts as a CPU-tier hit for every engine. The block hash of an object is read from its
key, as Mooncake's publisher does: the key itself, or its last ``@``/``/``/``:``-separated part,
as a decimal or ``0x`` hex u64. Keys without one are not published.
"""

from __future__ import annotations

import re

from kvplane.kvevents.codec import removed, stored
from kvplane.kvevents.publisher import KVEventPublisher

_SPLIT = re.compile(r"[@/:]")
U64 = (1 << 64) - 1


def key_hash(key: str) -> int | None:
    """The u64 block hash carried by ``key``, or None."""
    tail = _SPLIT.split(key)[-1].strip().lower()
    try:
        if tail.startswith("0x"):
            return int(tail, 16) & U64
        if tail.isdigit():
            return int(tail) & U64
    except ValueError:
        return None
    return None


class PoolEvents:
    """Publishes the master's object changes; call ``publish`` under the master's lock.

    Args:
        host: bind address of the PUB and replay sockets.
        port: PUB port (0 picks one); the replay ROUTER gets a free port.
        topic: topic frame of every message.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, topic: str = "") -> None:
        self.pub = KVEventPublisher(host=host, port=port or None, topic=topic)
        self.endpoint = self.pub.endpoint
        self.replay_endpoint = self.pub.replay_endpoint

    def publish(self, changes: list[tuple[str, str]]) -> int:
        """Send one batch for ``changes`` ((kind, key) pairs); returns the events sent."""
        put = [h for kind, k in changes if kind == "stored" and (h := key_hash(k)) is not None]
        gone = [h for kind, k in changes if kind == "removed" and (h := key_hash(k)) is not None]
        events = []
        if gone:
            events.append(removed(gone, medium="CPU"))
        if put:
            events.append(stored(put, [], 0, medium="CPU"))
        if events:
            self.pub.publish(events)
        return len(put) + len(gone)

    def close(self) -> None:
        self.pub.close()
