"""Transport plugins. Built-ins are registered by name in ``kvplane.transfer.plugins`` and
imported only when an engine loads them.

A new transport (RDMA, NIXL, CUDA IPC) is a module here (or anywhere) registered with
``TRANSPORTS.register(name, "module:Class")``; the engine needs no change (docs/transfer.md,
"Adding a transport").
"""

from kvplane.transfer.plugins import TRANSPORTS
from kvplane.transfer.seam import Capabilities, Route, Transport

__all__ = ["TRANSPORTS", "Capabilities", "Route", "Transport"]
