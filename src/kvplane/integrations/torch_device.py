"""TorchCopier for the connectors: re-exported from :mod:`kvplane.transfer.torch_device`, where
the transfer engine reaches it too (it moved there so transfer need not import integrations).

Imports torch at module import, as before.
"""

from __future__ import annotations

from kvplane.transfer.torch_device import TorchCopier

__all__ = ["TorchCopier"]
