"""kvplane's stand-in for the ``mooncake`` package (see kvplane.integrations.mooncake_shim)."""

from kvplane.compat.mooncake_buffer_pool import BufferPool, RegisteredBufferPool

__all__ = ["BufferPool", "RegisteredBufferPool"]
