"""Test and benchmark names for the vLLM-format publisher (kept for existing callers)."""

from kvplane.conductor.publisher import *  # noqa: F401,F403
from kvplane.conductor.publisher import KVEventPublisher, cleared, encode_batch, removed, stored

FakeKVPublisher = KVEventPublisher

__all__ = ["FakeKVPublisher", "KVEventPublisher", "cleared", "encode_batch", "removed", "stored"]
