"""KVPlaneHiCacheStorage: SGLang's HiCache L3 storage on kvplane's store, without the facade.

Loaded by SGLang's ``dynamic`` storage backend::

    --hicache-storage-backend dynamic --hicache-mem-layout page_first
    --hicache-storage-backend-extra-config '{"backend_name": "kvplane",
        "module_path": "kvplane.integrations.sglang.hicache",
        "class_name": "KVPlaneHiCacheStorage", "interface_v1": true,
        "master_server_address": "127.0.0.1:50051", "protocol": "auto"}'

``interface_v1`` selects SGLang's zero-copy calls: ``batch_set_v1`` / ``batch_get_v1`` move each
page straight between the registered host pool and the store (one ``batch_put_from`` or
``batch_get_into`` per batch, no staging), ``batch_exists`` answers with the number of leading
pages present (one RPC; the count stops at the first miss). Pages are stored as the page-first
layouts lay them out: one contiguous region per part (K and V for MHA, one for MLA), see
:mod:`kvplane.integrations.sglang.keys`. Failures never reach SGLang: a failed read or exists is
a miss (SGLang recomputes), a failed write is logged and reported as False.

SGLang hands this backend its host pool (its own HiCache controller moves KV between the GPU and
that pool). A pool that lives in device memory anyway is never registered as host memory: its
pages move by address through host staging (:mod:`kvplane.integrations.device_kv`), and a
failed device copy is a failed page.

Imports SGLang and torch at module import; ``kvplane.integrations.sglang`` itself does not.
"""

from __future__ import annotations

import logging
import re
from typing import Any, cast

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvplane.common.errors import InvalidArgument, KVPlaneError
from kvplane.integrations.device_kv import DeviceStaging, device_of
from kvplane.integrations.sglang.keys import PageKeys, leading_pages, shard_name
from kvplane.integrations.store_backend import StoreBackendConfig

log = logging.getLogger(__name__)
LAYOUTS = ("page_first", "page_first_direct")
# extra_config keys that belong to SGLang or to its dynamic loader, not to kvplane.
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size",
               "extra_backend_tag", "allocator", "prefetch_threshold")


class KVPlaneHiCacheStorage(HiCacheStorage):
    """A ``HiCacheStorage`` over a kvplane store client (thread-safe; SGLang calls it from its
    prefetch, IO and backup threads).

    Args:
        storage_config: SGLang's per-worker storage config; ``extra_config`` holds the kvplane
            settings (:class:`~kvplane.integrations.store_backend.StoreBackendConfig`).
        kwargs: what SGLang's dynamic loader passes (unused).

    Raises:
        InvalidArgument: an unknown setting, or a model split SGLang's page-first layouts cannot
            express (``should_split_heads``).
        Unavailable, Timeout: the master cannot be reached.
    """

    def __init__(self, storage_config: HiCacheStorageConfig,
                 kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.config = StoreBackendConfig.from_mapping(extra, ignore=SGLANG_KEYS)
        if storage_config.should_split_heads:
            raise InvalidArgument("kvplane HiCache backend: split heads (tp_lcm_size) "
                                  "is not supported; use a page_first layout without it")
        self.storage_config = storage_config
        self.prefix = self.config.key_prefix or "-".join(
            str(p) for p in (extra.get("extra_backend_tag"), storage_config.model_name) if p)
        self.shard = shard_name(storage_config.tp_rank, storage_config.tp_size,
                                storage_config.pp_rank, storage_config.pp_size,
                                storage_config.is_mla_model)
        self.keys: PageKeys | None = None
        self._registered: int | None = None
        self._staging: DeviceStaging | None = None
        self.client = self.config.open_client()
        log.info("kvplane HiCache backend: master %s, protocol %s, shard %s",
                 self.config.master_server_address, self.config.protocol, self.shard)

    # -- host pool ------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Register the host pool's KV buffer for zero-copy transfers (a pool in device memory:
        host staging for it instead, see ``StoreBackendConfig.staging``).

        Raises:
            InvalidArgument: the pool's layout is not page-first, or a device pool kvplane
                cannot copy.
        """
        super().register_mem_pool_host(mem_pool_host)
        layout = getattr(mem_pool_host, "layout", None)
        buf: Any = getattr(mem_pool_host, "kv_buffer", None)
        if layout not in LAYOUTS or not hasattr(buf, "data_ptr"):
            raise InvalidArgument(f"kvplane HiCache backend needs --hicache-mem-layout "
                                  f"page_first or page_first_direct, got {layout!r}")
        page = mem_pool_host.page_size
        ptrs, sizes = mem_pool_host.get_page_buffer_meta(torch.arange(page))
        self.keys = PageKeys(self.prefix, layout, str(buf.dtype).removeprefix("torch."), page,
                             self.shard, len(ptrs))
        if device_of(buf):
            self._staging = self.config.staging(buf, max(int(s) for s in sizes), self.client)
            log.info("kvplane HiCache backend: pool on %s, staged through %d B of host memory",
                     self._staging.device, self._staging.buffer.length)
            return
        self._registered = self.client.register_buffer(buf.data_ptr(), buf.numel() * buf.element_size())

    def _targets(self, keys: list[str], host_indices: torch.Tensor) -> tuple[list[str], list[int], list[int]]:
        assert self.keys is not None, "register_mem_pool_host was not called"
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        names = self.keys.pages(keys)
        if len(names) != len(ptrs):
            raise InvalidArgument(f"{len(keys)} pages but {len(ptrs)} host regions")
        return names, [int(p) for p in ptrs], [int(s) for s in sizes]

    # -- zero-copy v1 -----------------------------------------------------------------------------
    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store pages from the host pool; per page True when every part is stored (a page that
        was already stored counts as stored: the store keeps the first writer's bytes)."""
        if not keys:
            return []
        names, ptrs, sizes = self._targets(keys, host_indices)
        try:
            if self._staging is not None:
                res = self._staging.put(names, ptrs, sizes, self.client.batch_put_from,
                                        self.config.timeout)
            else:
                res = self.client.batch_put_from(names, ptrs, sizes)
        except KVPlaneError as exc:
            log.warning("kvplane HiCache: storing %d pages failed: %s", len(keys), exc)
            return [False] * len(keys)
        ok = [r is None for r in res]
        return self._per_page(ok, len(keys), "store")

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Load pages into the host pool; per page True when every part arrived whole.
        SGLang uses the leading run of True; a failure is a miss, never an exception."""
        if not keys:
            return []
        names, ptrs, sizes = self._targets(keys, host_indices)
        if self._staging is not None:  # never raises: a failed read or copy is a False page
            ok = self._staging.get(names, ptrs, sizes, self.client.batch_get_into,
                                   self.config.timeout)
            return self._per_page(ok, len(keys), "load")
        try:
            res = self.client.batch_get_into(names, ptrs, sizes)
        except KVPlaneError as exc:
            log.warning("kvplane HiCache: loading %d pages failed: %s", len(keys), exc)
            return [False] * len(keys)
        ok = [r == s for r, s in zip(res, sizes)]
        return self._per_page(ok, len(keys), "load")

    def _per_page(self, ok: list[bool], pages: int, what: str) -> list[bool]:
        parts = len(ok) // pages
        out = [all(ok[i * parts:(i + 1) * parts]) for i in range(pages)]
        if not all(out):
            log.warning("kvplane HiCache: %s failed for %d of %d pages", what,
                        out.count(False), pages)
        return out

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """The number of leading pages whose every part is in the store (0 on any error)."""
        if not keys:
            return 0
        parts = self.keys.parts if self.keys else 2
        names = self.keys.pages(keys) if self.keys else []
        try:
            found = self.client.batch_exists(names)
        except KVPlaneError as exc:
            log.warning("kvplane HiCache: exists for %d pages failed: %s", len(keys), exc)
            return 0
        return leading_pages(found, parts)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- copying API (SGLang's deprecated non-v1 path) -----------------------------------------
    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store flat pages (``get_data_page(i, flat=True)`` tensors); True if all stored."""
        if not keys:
            return True
        assert self.keys is not None, "register_mem_pool_host was not called"
        blobs = [b for v in values for b in _split(v, self.keys.parts)]
        try:
            res = self.client.put_batch(self.keys.pages(keys), blobs)
        except KVPlaneError as exc:
            log.warning("kvplane HiCache: storing %d pages failed: %s", len(keys), exc)
            return False
        return all(r is None for r in res)

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Fill the flat page tensors ``target_locations``; None where a page is missing."""
        if not keys:
            return []
        assert self.keys is not None, "register_mem_pool_host was not called"
        parts = self.keys.parts
        try:
            got = self.client.get_batch(self.keys.pages(keys))
        except KVPlaneError as exc:
            log.warning("kvplane HiCache: loading %d pages failed: %s", len(keys), exc)
            return [None] * len(keys)
        out: list[torch.Tensor | None] = []
        for i, target in enumerate(target_locations):
            blobs = got[i * parts:(i + 1) * parts]
            ok = all(isinstance(b, bytes) for b in blobs)
            out.append(_fill(target, cast("list[bytes]", blobs)) if ok else None)
        return out

    def get(self, key: str, target_location: Any = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    # -- housekeeping ------------------------------------------------------------------------------
    def clear(self) -> None:
        """Remove this worker's pages (its key namespace) from the store."""
        if self.keys is None:
            return
        try:
            n = self.client.remove_by_regex("^" + re.escape(self.keys.namespace + "/"))
            log.info("kvplane HiCache: cleared %d objects", n)
        except KVPlaneError as exc:
            log.warning("kvplane HiCache: clear failed: %s", exc)

    def close(self) -> None:
        """Release the host-pool registration and the store client (idempotent)."""
        if self._staging is not None:
            self._staging.close(self.client.unregister_buffer)
            self._staging = None
        if self._registered is not None:
            try:
                self.client.unregister_buffer(self._registered)
            except KVPlaneError as exc:
                log.debug("unregister failed: %s", exc)
            self._registered = None
        self.client.close()


def _split(value: torch.Tensor, parts: int) -> list[bytes]:
    """The page's bytes in ``parts`` equal pieces (a device tensor is copied to the host)."""
    raw = value.detach().contiguous().view(torch.uint8).reshape(-1).cpu().numpy().tobytes()
    step = len(raw) // parts
    return [raw[i * step:(i + 1) * step] for i in range(parts)]


def _fill(target: torch.Tensor, blobs: list[bytes]) -> torch.Tensor | None:
    """Copy ``blobs`` into ``target`` (host or device: ``copy_`` moves them), or None."""
    data = b"".join(blobs)
    flat = target.view(torch.uint8).view(-1)
    if len(data) != flat.numel():
        return None
    flat.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return target
