"""Mooncake's P2P store verbs on a Python facade over :class:`P2PNode`.

Mooncake's Go store (``mooncake-p2p-store``) has ``Register(name, addrList, sizeList,
maxShardSize)``, ``GetReplica(name, addrList, sizeList)``, ``Unregister(name)``,
``DeleteReplica(name)`` and ``List(prefix)`` on raw memory; this class keeps those verbs and
arguments in snake case. Errors raise from ``kvplane.common.errors`` (no integer codes).
Imports ``kvplane.p2p`` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvplane.common.errors import InvalidArgument
from kvplane.p2p.node import P2PConfig, P2PNode

DEFAULT_SHARD = 64 << 20  # Mooncake's recommended max shard size


def _buffers(addr_list: Sequence[int], size_list: Sequence[int]) -> list[tuple[str, tuple[int, int]]]:
    if len(addr_list) != len(size_list) or not addr_list:
        raise InvalidArgument("addr_list and size_list must be non-empty and of equal length")
    return [(f"buf{i}", (int(a), int(n))) for i, (a, n) in enumerate(zip(addr_list, size_list))]


class MooncakeP2PStore:
    """A P2P store node with Mooncake's verbs.

    Args:
        tracker: the tracker URL (Mooncake: ``metadataUri``).
        local_segment_name: accepted for signature parity; the node's name is its data address.
        **config: further :class:`P2PConfig` fields.
    """

    def __init__(self, tracker: str, local_segment_name: str = "", **config: Any) -> None:
        self.node = P2PNode(P2PConfig(tracker=tracker, **config))

    def register(self, name: str, addr_list: Sequence[int], size_list: Sequence[int],
                 max_shard_size: int = DEFAULT_SHARD) -> int:
        """Seed ``name`` from raw memory (registered in place); returns the version."""
        self.node.config = replace(self.node.config, chunk_size=max_shard_size)
        return self.node.publish(name, _buffers(addr_list, size_list))

    def get_replica(self, name: str, addr_list: Sequence[int], size_list: Sequence[int],
                    timeout: float | None = None) -> int:
        """Pull the latest ``name`` into raw memory and serve it from there; returns the version."""
        res = self.node.get(name, out=_buffers(addr_list, size_list), timeout=timeout)
        return res.manifest.version

    def unregister(self, name: str) -> None:
        """Stop seeding ``name`` from this node (Mooncake clears its gold locations)."""
        self.node.withdraw(name)

    def delete_replica(self, name: str) -> None:
        """Stop serving this node's replica of ``name``."""
        self.node.withdraw(name)

    def list(self, name_prefix: str = "") -> list[dict[str, Any]]:
        """Payloads whose name starts with ``name_prefix``."""
        return self.node.ls(name_prefix)

    def close(self) -> None:
        """Withdraw everything and stop the node."""
        self.node.close()

    def __enter__(self) -> MooncakeP2PStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
