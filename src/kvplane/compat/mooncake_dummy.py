"""``MooncakeDistributedStore.setup_dummy`` and ``alloc_from_mem_pool``: the dummy-client mode.

``setup_dummy(mem_pool_size, local_buffer_size, server_address)`` connects this store to a
``kvplane client-server`` on the same host (Mooncake's ``mooncake_client``) instead of the
master: no segment, no master connection, no transfer engine here. Memory from
``alloc_from_mem_pool`` is shared with the server, so puts and gets of it are zero-copy; other
registered memory is staged through the local buffer. Every other call keeps its Mooncake
behaviour (``kvplane.store.dummy``).

A mixin of ``mooncake_store.MooncakeDistributedStore``; imports ``kvplane.store`` only.
"""

from __future__ import annotations

import logging
from typing import Any

from kvplane.common.errors import KVPlaneError
from kvplane.compat.mooncake_types import INTERNAL_ERROR, INVALID_PARAMS, OK, code_of
from kvplane.store.config import StoreConfig
from kvplane.store.dummy.client import DummyClient

log = logging.getLogger(__name__)


class DummyMixin:
    """See the module docstring."""

    _c: Any
    _local_buffer: int

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int, server_address: str) -> int:
        """Attach to the client server at ``server_address`` ("host:port"); 0 or a code."""
        for name, value in (("mem_pool_size", mem_pool_size),
                            ("local_buffer_size", local_buffer_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise TypeError(f"setup_dummy(): {name} must be an unsigned int, got {value!r}")
        if not isinstance(server_address, str):
            raise TypeError("setup_dummy(): server_address must be a str")
        if self._c is not None:
            log.error("setup_dummy: this store is set up already; close() it first")
            return INVALID_PARAMS
        try:
            self._c = DummyClient(server_address.removeprefix("tcp://"), mem_pool_size,
                                  local_buffer_size, token=StoreConfig.from_env().token)
        except KVPlaneError as exc:
            log.error("setup_dummy failed: %s", exc)
            return code_of(exc)
        except OSError as exc:
            log.error("setup_dummy failed: %s", exc)
            return INTERNAL_ERROR
        self._local_buffer = local_buffer_size
        return OK

    def alloc_from_mem_pool(self, size: int) -> int:
        """Shared memory for zero-copy calls of a dummy client: its address, 0 on failure (a
        real client has no such pool and answers 0, as Mooncake's does)."""
        if isinstance(self._c, DummyClient):
            return self._c.alloc_from_mem_pool(int(size))
        return 0
