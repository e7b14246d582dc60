"""``mooncake.store`` on kvplane: MooncakeDistributedStore and ReplicateConfig.

Adds the one call vLLM's MooncakeStoreConnector makes that the compat facade lacks,
``batch_get_replica_desc`` (used there only to label load logs by tier): kvplane keeps every
replica in DRAM, so each present key reports one memory replica.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvplane.compat.mooncake import MooncakeDistributedStore as _Store
from kvplane.compat.mooncake import ReplicateConfig


class ReplicaDesc:
    """The part of Mooncake's replica descriptor that callers query."""

    def is_memory_replica(self) -> bool:
        return True

    def is_disk_replica(self) -> bool:
        return False

    def is_local_disk_replica(self) -> bool:
        return False


class MooncakeDistributedStore(_Store):
    """kvplane.compat.mooncake's store plus ``batch_get_replica_desc``."""

    def batch_get_replica_desc(self, keys: Sequence[str]) -> dict[str, list[ReplicaDesc]]:
        """key -> one memory replica if the key is stored, else an empty list."""
        codes = self.batch_is_exist(list(keys))
        return {k: [ReplicaDesc()] if c == 1 else [] for k, c in zip(keys, codes)}


__all__ = ["MooncakeDistributedStore", "ReplicaDesc", "ReplicateConfig"]
