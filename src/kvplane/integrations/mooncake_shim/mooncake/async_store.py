"""``mooncake.async_store`` on kvplane: ``MooncakeDistributedStoreAsync``."""

from kvplane.compat.mooncake_async import MooncakeDistributedStoreAsync

__all__ = ["MooncakeDistributedStoreAsync"]
