"""``MooncakeDistributedStore``'s tensor family (filled in below)."""

from __future__ import annotations


class TensorMixin:
    """Tensor calls."""
