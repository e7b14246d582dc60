"""Elastic expert parallelism: DeepEP's Buffer API with Mooncake EP's ``active_ranks``/``timeout_us``.

CPU reference implementation over the ``kvplane`` collectives backend.
"""

from kvplane.ep.buffers import Buffer, DispatchHandle, LowLatencyHandle

__all__ = ["Buffer", "DispatchHandle", "LowLatencyHandle"]
