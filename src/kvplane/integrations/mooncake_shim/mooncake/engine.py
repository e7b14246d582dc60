"""``mooncake.engine`` on kvplane: the TransferEngine facade of kvplane.compat.mooncake."""

from kvplane.compat.mooncake import TransferEngine, TransferNotify, TransferOpcode

__all__ = ["TransferEngine", "TransferNotify", "TransferOpcode"]
