"""KVPlaneConnector: an LMCache remote connector on kvplane's store, without the facade.

Registered through LMCache's ``remote_storage_plugins`` (docs/engines.md)::

    remote_storage_plugins: ["kvplane"]
    extra_config:
      remote_storage_plugin.kvplane.module_path: kvplane.integrations.lmcache
      remote_storage_plugin.kvplane.class_name: KVPlaneConnectorAdapter
      remote_storage_plugin.kvplane.url: kvplane://127.0.0.1:50051
      remote_storage_plugin.kvplane.protocol: auto        # any StoreBackendConfig key

The adapter claims ``kvplane://`` URLs and the ``plugin://kvplane[.name]`` URL LMCache gives the
plugin's backend. Chunks move between LMCache's memory objects and the store with one
``batch_put_from`` / ``batch_get_into`` per batch, straight from and into the registered buffer
of LMCache's CPU allocator (zero copy; an object outside it goes through the copying calls).
An allocator buffer in device memory is never registered as host memory: objects in it move by
address through host staging (:mod:`kvplane.integrations.device_kv`); any other device object
is copied with torch (never read through a host view of its address). A failed copy is a miss.
``batched_contains`` answers with the leading hits in one RPC. Keys keep ``CacheEngineKey``
intact (:mod:`kvplane.integrations.lmcache.keys`) and carry the chunk's KV-event hash, so the
store's KV events show the pool's chunks to a conductor. ``list`` returns the key strings of
the chunks in the store (one ``list_keys`` listing of the ``lmcache/`` namespace). A failed read
or lookup is a miss; a failed write is logged and counted; nothing on the cache path raises into
LMCache (``list``, an admin call, does).

Imports LMCache and torch at module import; ``kvplane.integrations.lmcache`` itself does not.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvplane.common.errors import InvalidArgument, KVPlaneError
from kvplane.integrations.device_kv import DeviceStaging, device_of
from kvplane.integrations.lmcache.keys import NAMESPACE, key_string, leading, store_key
from kvplane.integrations.lmcache.settings import SCHEME, claims, plugin_settings

log = logging.getLogger(__name__)
class KVPlaneConnector(RemoteConnector):
    """LMCache ``RemoteConnector`` over a kvplane store client.

    Args:
        loop: LMCache's event loop (the async methods run on it).
        local_cpu_backend: LMCache's CPU backend: allocator of the memory objects.
        config: the LMCache engine config (its ``extra_config`` holds the plugin settings).
        url: the URL LMCache resolved (``kvplane://...`` or ``plugin://kvplane``).
        plugin_name: the plugin instance name (``kvplane`` or ``kvplane.<name>``).

    Raises:
        InvalidArgument: bad settings, or layerwise mode (not supported).
        Unavailable, Timeout: the master cannot be reached.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any,
                 url: str = "", plugin_name: str | None = None) -> None:
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        if config.use_layerwise:
            raise InvalidArgument("the kvplane LMCache connector does not support use_layerwise")
        self.settings = plugin_settings(config.extra_config, plugin_name or "kvplane", url)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.client = self.settings.open_client()
        self._region: tuple[int, int] | None = None
        self._staging: DeviceStaging | None = None
        self.put_failures = 0
        self._register_allocator()
        log.info("kvplane LMCache connector: master %s, protocol %s, zero-copy region %s",
                 self.settings.master_server_address, self.settings.protocol, self._region)

    def _register_allocator(self) -> None:
        pin = getattr(getattr(self.local_cpu_backend, "memory_allocator", None), "pin_allocator", None)
        buf: Any = getattr(pin, "buffer", None)
        if buf is None or not hasattr(buf, "data_ptr"):  # a tensor (host or device), else none
            return
        size = buf.numel() * buf.element_size()
        if device_of(buf):
            self._staging = self.settings.staging(buf, self.full_chunk_size_bytes, self.client)
        else:
            self.client.register_buffer(buf.data_ptr(), size)
        self._region = (buf.data_ptr(), size)

    def _zero_copy(self, obj: MemoryObj) -> bool:
        """Whether ``obj`` lies in the registered allocator buffer (host, or staged device)."""
        if self._region is None:
            return False
        start, size = self._region
        return start <= obj.data_ptr and obj.data_ptr + obj.get_size() <= start + size

    @staticmethod
    def _key(key: CacheEngineKey) -> str:
        return store_key(key.to_string(), key.chunk_hash)

    # -- exists -----------------------------------------------------------------------------------
    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        """Leading keys present in the store (one RPC; 0 on any error)."""
        if not keys:
            return 0
        try:
            return leading(self.client.batch_exists([self._key(k) for k in keys]))
        except KVPlaneError as exc:
            log.warning("kvplane LMCache: contains of %d chunks failed: %s", len(keys), exc)
            return 0

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self.batched_contains([key]) == 1

    async def exists(self, key: CacheEngineKey) -> bool:
        return await asyncio.to_thread(self.exists_sync, key)

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey],
                                     pin: bool = False) -> int:
        return await asyncio.to_thread(self.batched_contains, keys)

    # -- get --------------------------------------------------------------------------------------
    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """One memory object per key (a partial last chunk is reshaped), None where missing."""
        objs = [self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
                for _ in keys]
        got = await asyncio.to_thread(self._read, [self._key(k) for k in keys], objs)
        out: list[MemoryObj | None] = []
        for obj, n in zip(objs, got):
            out.append(self._finish(obj, n))
        return out

    def _read(self, names: list[str], objs: list[MemoryObj | None]) -> list[int]:
        """Bytes read per object (<= 0: missing or failed)."""
        got = [0] * len(names)
        present = {i: o for i, o in enumerate(objs) if o is not None}
        direct = [i for i, o in present.items() if self._zero_copy(o)]
        staged = [i for i, o in present.items() if not self._zero_copy(o)]
        try:
            if direct and self._staging is not None:
                sizes = [present[i].get_size() for i in direct]
                arrived = self._staging.get([names[i] for i in direct],
                                            [present[i].data_ptr for i in direct], sizes,
                                            self.client.batch_get_into, self.settings.timeout)
                for i, n, ok in zip(direct, sizes, arrived):
                    got[i] = n if ok else -1
            elif direct:
                res = self.client.batch_get_into([names[i] for i in direct],
                                                 [present[i].data_ptr for i in direct],
                                                 [present[i].get_size() for i in direct])
                for i, r in zip(direct, res):
                    got[i] = r if isinstance(r, int) else -1
            if staged:
                for i, blob in zip(staged, self.client.get_batch([names[i] for i in staged])):
                    got[i] = _copy_into(present[i], blob) if isinstance(blob, bytes) else -1
        except KVPlaneError as exc:
            log.warning("kvplane LMCache: get of %d chunks failed: %s", len(names), exc)
            return [-1] * len(names)
        bad = sum(1 for i in direct + staged if got[i] <= 0)
        if bad:
            log.warning("kvplane LMCache: %d of %d chunks not read (a miss)", bad, len(names))
        return got

    def _finish(self, obj: MemoryObj | None, n: int) -> MemoryObj | None:
        if obj is None:
            return None
        if n > 0:
            try:
                return self.reshape_partial_chunk(obj, n)
            except ValueError as exc:
                log.warning("kvplane LMCache: stored chunk has a bad size: %s", exc)
        obj.ref_count_down()
        return None

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self.batched_get([key]))[0]

    async def batched_get_non_blocking(self, lookup_id: str,
                                       keys: list[CacheEngineKey]) -> list[MemoryObj]:
        """The leading run of chunks that arrived; the ones after a miss are released."""
        out: list[MemoryObj] = []
        broken = False
        for obj in await self.batched_get(keys):
            if obj is None:
                broken = True
            elif broken:
                obj.ref_count_down()
            else:
                out.append(obj)
        return out

    # -- put --------------------------------------------------------------------------------------
    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        """Store chunks (LMCache's wrapper releases the objects afterwards)."""
        if keys:
            await asyncio.to_thread(self._write, [self._key(k) for k in keys], memory_objs)

    def _write(self, names: list[str], objs: list[MemoryObj]) -> None:
        direct = [i for i, o in enumerate(objs) if self._zero_copy(o)]
        staged = [i for i, o in enumerate(objs) if not self._zero_copy(o)]
        try:
            res = []
            put = self.client.batch_put_from
            if direct:
                args = ([names[i] for i in direct], [objs[i].data_ptr for i in direct],
                        [objs[i].get_size() for i in direct])
                res += self._staging.put(*args, put, self.settings.timeout) \
                    if self._staging is not None else put(*args)
            if staged:
                res += self.client.put_batch([names[i] for i in staged],
                                             [_host_bytes(objs[i]) for i in staged])
        except KVPlaneError as exc:
            self.put_failures += len(names)
            log.warning("kvplane LMCache: put of %d chunks failed: %s", len(names), exc)
            return
        failed = [r for r in res if r is not None]
        if failed:
            self.put_failures += len(failed)
            log.warning("kvplane LMCache: %d of %d chunks not stored: %s", len(failed),
                        len(names), failed[0])

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    # -- the rest ---------------------------------------------------------------------------------
    def remove_sync(self, key: CacheEngineKey) -> bool:
        try:
            self.client.remove(self._key(key))
        except KVPlaneError:
            return False
        return True

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when the master answers, else the kvplane error code."""
        try:
            await asyncio.to_thread(self.client.health_check)
        except KVPlaneError as exc:
            return exc.code
        return 0

    async def list(self) -> list[str]:
        """The ``CacheEngineKey.to_string()`` of every chunk in the store (every LMCache
        instance's on this pool, in the caller's tenant), in ascending store-key order.

        An admin call, not the cache path: errors raise (a partial list would look whole).

        Raises:
            Unavailable, Timeout: the master cannot be reached, or the listing took longer
                than the client's timeout.
        """
        names = await asyncio.to_thread(self.client.list_keys, NAMESPACE)
        return [s for s in map(_chunk_key, names) if s is not None]

    async def close(self) -> None:
        await asyncio.to_thread(self.client.close)

    def __repr__(self) -> str:
        return f"<KVPlaneConnector {self.settings.master_server_address}>"


def _chunk_key(name: str) -> str | None:
    """The LMCache key string of store key ``name``; None for another writer's key that only
    shares the namespace prefix."""
    try:
        return key_string(name)
    except ValueError:
        return None


def _host_bytes(obj: MemoryObj) -> bytes:
    """The object's bytes; a device object is copied with torch (its ``byte_array`` would be a
    host view of a device address)."""
    raw = obj.raw_tensor
    if raw is not None and device_of(raw):
        return bytes(raw.reshape(-1).view(torch.uint8)[:obj.get_size()].cpu().numpy().tobytes())
    return bytes(obj.byte_array)


def _copy_into(obj: MemoryObj, data: bytes) -> int:
    raw = obj.raw_tensor
    if raw is None or len(data) > obj.get_size():
        return -1
    raw.view(torch.uint8).view(-1)[:len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return len(data)


class KVPlaneConnectorAdapter(ConnectorAdapter):
    """LMCache adapter for ``kvplane://host:port`` and ``plugin://kvplane[.name]`` URLs."""

    def __init__(self) -> None:
        super().__init__(SCHEME)

    def can_parse(self, url: str) -> bool:
        return claims(url)

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        plugin = context.plugin_name
        if plugin is None and context.url.startswith("plugin://"):
            plugin = context.url[len("plugin://"):]
        return KVPlaneConnector(context.loop, context.local_cpu_backend, context.config,
                                url=context.url, plugin_name=plugin or "kvplane")
