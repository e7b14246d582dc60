"""The store's KV events: BlockStored / BlockRemoved in vLLM's wire format, medium "CPU".

A conductor registers the store as a shared pool (``"type": "kvplane"``), so a prefix held in
the pool counts as a CPU-tier hit for every engine. The block hash of an object is read from its
key, as Mooncake's publisher does: the key itself, or its last ``@``/``/``/``:``-separated part,
as a decimal or ``0x`` hex u64. Keys without one are not published.

With a service token the events go through :class:`~kvplane.kvevents.secure.SecurePublisher`:
subscribers authenticate with ZMQ PLAIN (the token as password) and see only their own
tenant's stream. Without one (``--no-auth``) the plain vLLM publisher serves the default
tenant's events only.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import msgspec

from kvplane.common.auth import DEFAULT_TENANT, TokenTable
from kvplane.kvevents.codec import removed, stored
from kvplane.kvevents.publisher import KVEventPublisher
from kvplane.kvevents.secure import SecurePublisher
from kvplane.store.master.access import unscoped

_SPLIT = re.compile(r"[@/:]")
U64 = (1 << 64) - 1
# kvplane's vLLM connectors: ``.../tp{r}of{n}/{block hash hex}/{layer}`` (KVPlaneStoreConnector,
# a 32-byte hash) and ``.../r{r}of{n}/off/{OffloadKey hex}/{layer}`` (the OffloadingConnector's
# medium: the hash and a 4-byte KV-cache group index)
_LAYERED = re.compile(
    r"(?:^|/)(?:(?:tp|r)(\d+)of\d+/(?:off/)?)?([0-9a-f]{64})([0-9a-f]{8})?/(\d+)$")


def key_hash(key: str) -> int | None:
    """The u64 block hash carried by ``key``, or None.

    A key of kvplane's vLLM connectors (one object per block and layer, the block's vLLM hash
    in hex before the layer) names its block by layer 0 of TP rank 0 and KV-cache group 0
    only: the event hash is the low 64 bits of the vLLM hash (what vLLM's own KV events carry
    for that block), and the block's other objects publish nothing. Any other key: Mooncake's
    rule, its last ``@``/``/``/``:``-separated part as a decimal or ``0x`` hex u64.
    """
    m = _LAYERED.search(key)
    if m is not None:
        rank, digest, group, layer = m.groups()
        if (rank and int(rank)) or (group and int(group, 16)) or int(layer):
            return None
        return int(digest[-16:], 16)
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
        topic: topic frame of every message (unauthenticated publisher only).
        auth: the master's tokens; with a service token, subscribers must present one.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, topic: str = "",
                 auth: TokenTable | None = None) -> None:
        self.secure: SecurePublisher | None = None
        self.plain: KVEventPublisher | None = None
        self.pub: KVEventPublisher | SecurePublisher
        if auth is not None and auth.token:
            self.secure = self.pub = SecurePublisher(auth, host, port)
        else:
            self.plain = self.pub = KVEventPublisher(host=host, port=port or None, topic=topic)
        self.endpoint = self.pub.endpoint
        self.replay_endpoint = self.pub.replay_endpoint

    def publish(self, changes: Sequence[tuple[str, str]]) -> int:
        """Send one batch per tenant for ``changes`` ((kind, key) pairs); returns events sent."""
        by_tenant: dict[str, list[tuple[str, str]]] = {}
        for kind, internal in changes:
            tenant, key = unscoped(internal)
            by_tenant.setdefault(tenant, []).append((kind, key))
        sent = 0
        for tenant, items in by_tenant.items():
            if self.secure is None and tenant != DEFAULT_TENANT:
                continue  # unauthenticated stream: nobody could be told apart
            events, n = _events(items)
            if not events:
                continue
            if self.secure is not None:
                self.secure.publish(tenant, events)
            elif self.plain is not None:
                self.plain.publish(events)
            sent += n
        return sent

    def close(self) -> None:
        self.pub.close()


def _events(items: list[tuple[str, str]]) -> tuple[list[msgspec.Struct], int]:
    put = [h for kind, k in items if kind == "stored" and (h := key_hash(k)) is not None]
    gone = [h for kind, k in items if kind == "removed" and (h := key_hash(k)) is not None]
    events: list[msgspec.Struct] = []
    if gone:
        events.append(removed(gone, medium="CPU"))
    if put:
        events.append(stored(put, [], 0, medium="CPU"))
    return events, len(put) + len(gone)
