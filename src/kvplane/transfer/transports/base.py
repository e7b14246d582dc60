"""The Transport seam, as plugins import it: re-exports ``kvplane.transfer.seam``.

Kept so a plugin's imports read ``transports.base`` (the testing kit's ``mem`` transport does);
the definitions live in the seam module, which the engine may import (it may not import any
module under ``kvplane.transfer.transports``).
"""

from __future__ import annotations

from kvplane.transfer.seam import (
    Capabilities,
    ControlChannel,
    OneItemIO,
    Prunable,
    Route,
    Transport,
    TransportContext,
    VectoredIO,
)

__all__ = ["Capabilities", "ControlChannel", "OneItemIO", "Prunable", "Route", "Transport",
           "TransportContext", "VectoredIO"]
