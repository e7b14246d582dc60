"""``mooncake.buffer_pool`` on kvplane: ``BufferPool`` (``RegisteredBufferPool`` is its old name)."""

from kvplane.compat.mooncake_buffer_pool import BufferLease, BufferPool, RegisteredBufferPool

__all__ = ["BufferLease", "BufferPool", "RegisteredBufferPool"]
