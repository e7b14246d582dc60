"""``MooncakeDistributedStore.setup_dummy`` (filled in below)."""

from __future__ import annotations


class DummyMixin:
    """Dummy-client calls."""
