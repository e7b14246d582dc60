"""Mooncake-compatible store facade: ``MooncakeDistributedStore`` and ``ReplicateConfig``.

Same method names, argument order and return conventions as ``mooncake.store``: 0 or a byte
count on success, a negative Mooncake ErrorCode on failure (-704 OBJECT_NOT_FOUND, -706
OBJECT_HAS_LEASE, -200 NO_AVAILABLE_HANDLE, ...); ``get`` returns empty bytes on a miss and
``is_exist`` returns 1/0. Import from ``kvplane.compat.mooncake``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvplane.common.config import parse_size
from kvplane.common.errors import KVPlaneError
from kvplane.store.client.client import StoreClient
from kvplane.store.config import StoreConfig
from kvplane.store.types import ReplicateConfig as _Cfg

log = logging.getLogger(__name__)
INTERNAL_ERROR = -1
RPC_FAIL = -900


class ReplicateConfig:
    """Mooncake's ReplicateConfig (mutable attributes, as in the pybind class)."""

    def __init__(self) -> None:
        self.replica_num = 1
        self.with_soft_pin = False
        self.soft_pin_ttl_ms: int | None = None
        self.with_hard_pin = False
        self.preferred_segment = ""
        self.preferred_segments: list[str] = []
        self.prefer_alloc_in_same_node = False

    def native(self) -> _Cfg:
        return _Cfg(replica_num=self.replica_num, with_hard_pin=self.with_hard_pin,
                    with_soft_pin=self.with_soft_pin, soft_pin_ttl_ms=self.soft_pin_ttl_ms,
                    preferred_segment=self.preferred_segment,
                    preferred_segments=list(self.preferred_segments),
                    prefer_alloc_in_same_node=self.prefer_alloc_in_same_node)


def _cfg(config: Any) -> _Cfg | None:
    return config.native() if isinstance(config, ReplicateConfig) else config


def _code(exc: KVPlaneError) -> int:
    """Mooncake's integer code for a kvplane error (store errors carry theirs; the rest are
    reported as RPC_FAIL, as Mooncake reports a failed master call)."""
    return exc.code if -1000 < exc.code < 0 else RPC_FAIL


def _codes(results: Sequence[Any]) -> list[int]:
    """Per-key batch results (None, a count, or an exception) as Mooncake's ints."""
    return [_code(r) if isinstance(r, KVPlaneError) else (r or 0) for r in results]


class MooncakeDistributedStore:
    """Mooncake's store client with kvplane underneath."""

    def __init__(self) -> None:
        self._c: StoreClient | None = None

    # -- setup ---------------------------------------------------------------------------------
    def setup(self, local_hostname: Any, metadata_server: str = "P2PHANDSHAKE",
              global_segment_size: int | str = 16 << 20, local_buffer_size: int | str = 16 << 20,
              protocol: str = "tcp", rdma_devices: str = "", master_server_addr: str = "127.0.0.1:50051",
              engine: Any = None, *args: Any, **kwargs: Any) -> int:
        """``setup(local_hostname, metadata_server, global_segment_size, local_buffer_size,
        protocol, rdma_devices, master_server_addr)`` or ``setup(config_dict)``. 0 on success."""
        if isinstance(local_hostname, dict):
            d = local_hostname
            return self.setup(d.get("local_hostname", "127.0.0.1"),
                              d.get("metadata_server", "P2PHANDSHAKE"),
                              d.get("global_segment_size", 16 << 20),
                              d.get("local_buffer_size", 16 << 20), d.get("protocol", "tcp"),
                              d.get("device_name", ""),
                              d.get("master_server_address", "127.0.0.1:50051"))
        host = str(local_hostname).rsplit(":", 1)[0] if str(local_hostname).count(":") == 1 else str(local_hostname)
        proto = {"rdma": "tcp", "": "auto"}.get(protocol.lower(), protocol.lower())
        try:
            self._c = StoreClient(StoreConfig.from_env(
                master=master_server_addr.removeprefix("tcp://"), metadata=metadata_server,
                local_hostname=host, protocol=proto,
                global_segment_size=parse_size(global_segment_size),
                local_buffer_size=parse_size(local_buffer_size)))
        except KVPlaneError as exc:
            log.error("setup failed: %s", exc)
            return _code(exc)
        except OSError as exc:
            log.error("setup failed: %s", exc)
            return INTERNAL_ERROR
        return 0

    def init_all(self, protocol: str, device_name: str, mount_segment_size: int = 16 << 20) -> int:
        return self.setup("127.0.0.1", "P2PHANDSHAKE", mount_segment_size, 16 << 20, protocol)

    @property
    def client(self) -> StoreClient:
        if self._c is None:
            raise RuntimeError("MooncakeDistributedStore is not set up")
        return self._c

    def _safe(self, fn: Any, *a: Any, default: Any = None) -> Any:
        """Call the native client; None becomes 0, an exception its code (or ``default``)."""
        try:
            out = fn(*a)
        except KVPlaneError as exc:
            log.warning("%s failed: %s", getattr(fn, "__name__", "call"), exc)
            return _code(exc) if default is None else default
        return 0 if out is None else out

    def _batch(self, fn: Any, n: int, *a: Any) -> list[int]:
        """A native batch call as a list of ints (a whole-call failure repeats its code)."""
        r = self._safe(fn, *a)
        return [r] * n if isinstance(r, int) else _codes(r)

    # -- bytes API --------------------------------------------------------------------------------
    def put(self, key: str, value: Any, config: Any = None) -> int:
        return self._safe(self.client.put, key, value, _cfg(config))

    def put_parts(self, key: str, *parts: Any, config: Any = None) -> int:
        return self.put(key, b"".join(bytes(memoryview(p)) for p in parts), config)

    def put_batch(self, keys: Sequence[str], values: Sequence[Any], config: Any = None) -> int:
        codes = self._batch(self.client.put_batch, len(keys), list(keys), list(values), _cfg(config))
        return next((c for c in codes if c), 0)

    def upsert(self, key: str, value: Any, config: Any = None) -> int:
        return self._safe(self.client.upsert, key, value, _cfg(config))

    def upsert_batch(self, keys: Sequence[str], values: Sequence[Any], config: Any = None) -> int:
        codes = self._batch(self.client.put_batch, len(keys), list(keys), list(values),
                            _cfg(config), True)
        return next((c for c in codes if c), 0)

    def get(self, key: str) -> bytes:
        r = self._safe(self.client.get, key, default=b"")
        return r if isinstance(r, bytes) else b""

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        rs = self._safe(self.client.get_batch, list(keys), default=[b""] * len(keys))
        return [r if isinstance(r, bytes) else b"" for r in rs]

    # -- zero-copy ----------------------------------------------------------------------------------
    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        return self._safe(lambda: self.client.register_buffer(int(buffer_ptr), int(size)) and 0)

    def unregister_buffer(self, buffer_ptr: int) -> int:
        return self._safe(lambda: self.client.unregister_buffer(int(buffer_ptr)) or 0)

    def put_from(self, key: str, buffer_ptr: int, size: int, config: Any = None) -> int:
        return self._safe(self.client.put_from, key, int(buffer_ptr), int(size), _cfg(config))

    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: Any = None) -> int:
        return self._safe(self.client.upsert_from, key, int(buffer_ptr), int(size), _cfg(config))

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        return self._safe(self.client.get_into, key, int(buffer_ptr), int(size))

    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
                       config: Any = None) -> list[int]:
        return self._batch(self.client.batch_put_from, len(keys), list(keys), list(buffer_ptrs),
                           list(sizes), _cfg(config))

    def batch_upsert_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
                          config: Any = None) -> list[int]:
        return self._batch(self.client.batch_put_from, len(keys), list(keys), list(buffer_ptrs),
                           list(sizes), _cfg(config), True)

    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        return self._batch(self.client.batch_get_into, len(keys), list(keys), list(buffer_ptrs),
                           list(sizes))

    def batch_put_from_multi_buffers(self, keys: Sequence[str], all_buffer_ptrs: Sequence[Sequence[int]],
                                     all_sizes: Sequence[Sequence[int]], config: Any = None) -> list[int]:
        """One object per key, gathered from several registered fragments."""
        out = []
        for key, ptrs, sizes in zip(keys, all_buffer_ptrs, all_sizes):
            total = sum(sizes)
            with self.client.staging.block(total) as (addr, view):
                off = 0
                for p, n in zip(ptrs, sizes):
                    view[off:off + n] = np.frombuffer(self.client.engine.memory.view(int(p), int(n)), np.uint8)
                    off += n
                out.append(self._safe(self.client.put_from, key, addr, total, _cfg(config)))
        return out

    def batch_get_into_multi_buffers(self, keys: Sequence[str], all_buffer_ptrs: Sequence[Sequence[int]],
                                     all_sizes: Sequence[Sequence[int]]) -> list[int]:
        """Scatter each object into its registered fragments; bytes read or negative."""
        out = []
        for key, ptrs, sizes in zip(keys, all_buffer_ptrs, all_sizes):
            total = sum(sizes)
            with self.client.staging.block(total) as (addr, view):
                n = self._safe(self.client.get_into, key, addr, total)
                if n > 0:
                    off = 0
                    for p, k in zip(ptrs, sizes):
                        self.client.engine.memory.view(int(p), int(k))[:] = view[off:off + k].data
                        off += k
                out.append(n)
        return out

    # -- existence, size, removal -------------------------------------------------------------------
    def is_exist(self, key: str) -> int:
        """1 present, 0 absent, -1 on error (Mooncake's convention)."""
        return int(self._safe(self.client.exists, key, default=-1))

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        found = self._safe(self.client.batch_exists, list(keys), default=[-1] * len(keys))
        return [int(f) for f in found]

    def get_size(self, key: str) -> int:
        return self._safe(self.client.get_size, key)

    def remove(self, key: str, force: bool = False) -> int:
        return self._safe(self.client.remove, key, force)

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        return self._batch(self.client.batch_remove, len(keys), list(keys), force)

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        return self._safe(self.client.remove_by_regex, regex_pattern, force)

    def remove_all(self, force: bool = False) -> int:
        return self._safe(self.client.remove_all, force)

    def health_check(self) -> int:
        """0 healthy, 1 not set up or closed, 2 master unreachable (Mooncake's codes)."""
        if self._c is None:
            return 1
        try:
            self._c.health_check()
        except KVPlaneError:
            return 2
        return 0

    def get_hostname(self) -> str:
        return self.client.segment_name

    def close(self) -> int:
        if self._c is not None:
            self._c.close()
            self._c = None
        return 0
