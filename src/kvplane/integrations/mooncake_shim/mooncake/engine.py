"""``mooncake.engine`` on kvplane: the TransferEngine facade of kvplane.compat.mooncake.

``Read``/``Write`` are also module attributes, as in Mooncake's extension.
"""

from kvplane.compat.mooncake import TransferEngine, TransferNotify, TransferOpcode

Read = TransferOpcode.Read
Write = TransferOpcode.Write

__all__ = ["Read", "TransferEngine", "TransferNotify", "TransferOpcode", "Write"]
