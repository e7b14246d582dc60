"""kvplane's stand-in for the ``mooncake`` package (see kvplane.integrations.mooncake_shim)."""

__all__: list[str] = []
