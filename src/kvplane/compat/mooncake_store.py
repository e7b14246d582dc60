"""Mooncake-compatible store facade: ``MooncakeDistributedStore`` over kvplane's store client.

Same method names, argument order and return conventions as ``mooncake.store``: 0 or a byte
count on success, a negative Mooncake ErrorCode on failure (-704 OBJECT_NOT_FOUND, -706
OBJECT_HAS_LEASE, -600 INVALID_PARAMS, ...); ``get`` returns empty bytes on a miss, ``is_exist``
1/0 or a negative code, data getters None. Before ``setup()`` (or after a failed one) every call
answers as Mooncake's client does without a connection: -600, ``b""`` or None; it never raises.
kvplane exceptions become codes here and only here (``mooncake_types.code_of``).
``setup``'s ``tenant_id`` must name the tenant the client's token selects on the master (kvplane
tenants are chosen by token, see docs/security.md); tenants are pure clients (segment size 0).

This module holds setup, the bytes and zero-copy calls, existence and removal. The rest of the
class comes from mixins: ranges and sessions (``mooncake_ranges``), replica descriptors, copy/move
tasks and segments (``mooncake_admin``), the tensor family (``mooncake_tensor``) and the dummy
client (``mooncake_dummy``). Import from ``kvplane.compat.mooncake``.
"""

from __future__ import annotations

import errno
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvplane.common.errors import KVPlaneError
from kvplane.compat import mooncake_setup as setup_args
from kvplane.compat.mooncake_admin import AdminMixin
from kvplane.compat.mooncake_dummy import DummyMixin
from kvplane.compat.mooncake_ranges import RangesMixin
from kvplane.compat.mooncake_tensor import TensorMixin
from kvplane.compat.mooncake_types import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    OK,
    BufferHandle,
    ReplicateConfig,
    buffer_handle,
    check_config,
    code_of,
    natives,
)

log = logging.getLogger(__name__)

HC_OK, HC_NOT_INITIALIZED, HC_MASTER_UNREACHABLE = 0, 1, 2


def _as_bytes(value: Any, name: str = "value") -> memoryview:
    """A contiguous byte view of a buffer-protocol object (TypeError otherwise, as pybind)."""
    try:
        view = memoryview(value)
    except TypeError as exc:
        raise TypeError(f"{name}: expected a bytes-like object, got {type(value).__name__}") from exc
    return view if view.contiguous and view.format == "B" else memoryview(view.tobytes())


class MooncakeDistributedStore(RangesMixin, AdminMixin, TensorMixin, DummyMixin):
    """Mooncake's store client with kvplane underneath (see the module docstring)."""

    def __init__(self) -> None:
        self._c: Any = None  # a StoreClient, or a DummyClient after setup_dummy
        self._local_buffer = 0
        self._tenant = "default"
        self._init_mixins()

    def _init_mixins(self) -> None:
        RangesMixin.__init__(self)
        AdminMixin.__init__(self)

    # -- setup ---------------------------------------------------------------------------------
    def setup(self, *args: Any, **kwargs: Any) -> int:
        """``setup(local_hostname, metadata_server, global_segment_size, local_buffer_size,
        protocol, rdma_devices, master_server_addr, engine=None, enable_ssd_offload=False,
        ssd_offload_path="", tenant_id="default", enable_client_http_server=False,
        client_http_port=9300)`` or ``setup(config_dict)``. 0 on success, else a negative code.

        Raises:
            TypeError: arguments that fit neither form (missing, unknown, wrongly typed).
        """
        parsed = setup_args.parse(args, kwargs)
        if isinstance(parsed, int):
            return parsed
        if self._c is not None:
            log.error("setup: this store is set up already; close() it first")
            return INVALID_PARAMS
        if parsed.engine is not None:
            log.info("setup: an existing TransferEngine was passed; kvplane's store client "
                     "runs its own engine")
        if parsed.tenant_id != "default" and parsed.global_segment_size:
            log.error("setup: tenant %r: tenants are pure clients (only the service token mounts "
                      "segments): pass global_segment_size=0", parsed.tenant_id)
            return INVALID_PARAMS
        try:
            client = setup_args.open_client(parsed)
        except KVPlaneError as exc:
            log.error("setup failed: %s", exc)
            return code_of(exc)
        except OSError as exc:
            log.error("setup failed: %s", exc)
            # no free port left in Mooncake's client range either
            return INVALID_PARAMS if exc.errno == errno.EADDRINUSE else INTERNAL_ERROR
        rc = self._check_tenant(client, parsed.tenant_id)
        if rc:
            client.close()
            return rc
        self._c = client
        self._local_buffer = parsed.local_buffer_size
        self._tenant = parsed.tenant_id
        return OK

    def _check_tenant(self, client: Any, tenant: str) -> int:
        """A kvplane tenant is chosen by the token, not by the caller: ``tenant_id`` must name
        the tenant the master says the client's token selects (else -600, never a silently
        shared or foreign namespace). 0, or a negative code."""
        try:
            actual = client.rpc.call("whoami", client.config.client_id, str)
        except KVPlaneError as exc:
            log.error("setup: cannot ask the master for this token's tenant: %s", exc)
            return code_of(exc)
        if actual != tenant:
            log.error("setup: tenant_id %r, but the token (KVPLANE_TOKEN or the token file) is "
                      "tenant %r's: use that tenant's token", tenant, actual)
            return INVALID_PARAMS
        return OK

    def init_all(self, protocol: str, device_name: str, mount_segment_size: int = 16 << 20) -> int:
        """Mooncake's test-only setup: a segment of ``mount_segment_size`` on the default master."""
        return self.setup("127.0.0.1", "P2PHANDSHAKE", mount_segment_size, 1 << 30, protocol,
                          device_name, "127.0.0.1:50051")

    def close(self) -> int:
        """Release everything (idempotent); 0."""
        client, self._c = self._c, None
        self._close_mixins()
        if client is not None:
            try:
                client.close()
            except KVPlaneError as exc:
                log.warning("close: %s", exc)
        return OK

    def _close_mixins(self) -> None:
        AdminMixin._close(self)
        RangesMixin._close(self)

    def health_check(self) -> int:
        """0 healthy, 1 not set up or closed, 2 master unreachable (Mooncake's codes)."""
        if self._c is None:
            return HC_NOT_INITIALIZED
        try:
            self._c.health_check()
        except KVPlaneError:
            return HC_MASTER_UNREACHABLE
        return HC_OK

    def get_hostname(self) -> str:
        """This client's segment name, ``host:port`` ("" before setup)."""
        return self._c.segment_name if self._c is not None else ""

    @property
    def client(self) -> Any:
        """The native client (a ``kvplane.store.StoreClient``) for code that wants kvplane's API.

        Raises:
            RuntimeError: before setup.
        """
        if self._c is None:
            raise RuntimeError("MooncakeDistributedStore is not set up")
        return self._c

    # -- plumbing ----------------------------------------------------------------------------------
    def _rc(self, fn: Callable[..., Any] | None, *args: Any) -> Any:
        """Call the native client: None becomes 0, a kvplane error its code; -600 if not set up."""
        if self._c is None or fn is None:
            return INVALID_PARAMS
        try:
            out = fn(*args)
        except KVPlaneError as exc:
            log.warning("%s failed: %s", getattr(fn, "__name__", "call"), exc)
            return code_of(exc)
        return OK if out is None else out

    def _each(self, fn: Callable[..., Any], n: int, *args: Any) -> list[int]:
        """A native per-key batch call as ints (a whole-call failure repeats its code)."""
        out = self._rc(fn, *args)
        if isinstance(out, int):
            return [out] * n
        return [code_of(r) if isinstance(r, KVPlaneError) else (r or 0) for r in out]

    def _view(self, addr: int, size: int) -> memoryview:
        """A bounds-checked view of registered memory (raises AddressNotRegistered)."""
        return self._c.engine.memory.view(int(addr), int(size))

    def _grouped(self, cfg: ReplicateConfig | None, n: int,
                 call: Callable[[list[int], Any], list[int]]) -> list[int]:
        """Run ``call(indexes, native_config)`` once per distinct per-key config (group ids
        split a batch); per-key results in the caller's order."""
        out = [0] * n
        groups: dict[int, tuple[Any, list[int]]] = {}
        for i, native in enumerate(natives(cfg, n)):
            groups.setdefault(id(native) if cfg is None or cfg.group_ids is None else i,
                              (native, []))[1].append(i)
        by_cfg: dict[str, tuple[Any, list[int]]] = {}
        for native, idx in groups.values():
            key = "" if native is None else repr(native)
            by_cfg.setdefault(key, (native, []))[1].extend(idx)
        for native, idx in by_cfg.values():
            for i, rc in zip(idx, call(idx, native)):
                out[i] = rc
        return out

    # -- bytes API ----------------------------------------------------------------------------------
    def _put_values(self, keys: Sequence[str], values: Sequence[Any], config: Any,
                    upsert: bool) -> list[int]:
        if self._c is None:
            return [INVALID_PARAMS] * len(keys)
        views = [_as_bytes(v) for v in values]
        if len(keys) != len(views):
            return [INVALID_PARAMS] * len(keys)
        rc = check_config(config, len(keys), copying=True)
        if rc or (self._local_buffer == 0 and keys):
            if not rc:
                log.error("put: local_buffer_size is 0: this client cannot stage copying puts")
            return [rc or INVALID_PARAMS] * len(keys)

        def call(idx: list[int], native: Any) -> list[int]:
            return self._each(self._c.put_batch, len(idx), [keys[i] for i in idx],
                              [views[i] for i in idx], native, upsert)
        return self._grouped(config, len(keys), call)

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Store ``value`` (bytes-like) under ``key``; an existing key is left as it is."""
        return self._put_values([key], [value], config, False)[0]

    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Store ``value`` under ``key``, replacing what is there."""
        return self._put_values([key], [value], config, True)[0]

    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """One object made of ``parts`` concatenated."""
        return self.put(key, b"".join(_as_bytes(p, "part") for p in parts), config)

    def upsert_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        return self.upsert(key, b"".join(_as_bytes(p, "part") for p in parts), config)

    def put_batch(self, keys: Sequence[str], values: Sequence[Any],
                  config: ReplicateConfig | None = None) -> int:
        """0 if every key was stored, else the first failure's code."""
        return next((c for c in self._put_values(list(keys), list(values), config, False) if c), OK)

    def upsert_batch(self, keys: Sequence[str], values: Sequence[Any],
                     config: ReplicateConfig | None = None) -> int:
        return next((c for c in self._put_values(list(keys), list(values), config, True) if c), OK)

    def get(self, key: str) -> bytes:
        """The object's bytes; ``b""`` on a miss or any failure."""
        return self.get_batch([key])[0]

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        if self._c is None or (self._local_buffer == 0 and keys):
            return [b""] * len(keys)
        out = self._rc(self._c.get_batch, list(keys))
        if isinstance(out, int):
            return [b""] * len(keys)
        return [r if isinstance(r, bytes) else b"" for r in out]

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The object in registered memory as a buffer-protocol handle, or None on a miss."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: Sequence[str]) -> list[BufferHandle | None]:
        """Per key a BufferHandle (``ptr()``, ``size()``, buffer protocol) or None. The bytes
        stay in this client's local buffer until the handle is released or collected."""
        keys = list(keys)
        if self._c is None or not keys or self._local_buffer == 0:
            return [None] * len(keys)
        sizes = self._each(self._ops().batch_get_size, len(keys), keys)
        out: list[BufferHandle | None] = [None] * len(keys)
        taken = []
        for i, size in enumerate(sizes):
            if size > 0:
                block = self._c.staging.take(size)
                taken.append((i, size, block))
        got = self._each(self._c.batch_get_into, len(taken), [keys[i] for i, _, _ in taken],
                         [b[0] for _, _, b in taken], [s for _, s, _ in taken])
        for (i, _size, (addr, view, release)), n in zip(taken, got):
            if n > 0:
                out[i] = buffer_handle(addr, n, keep=view, release=release)
            else:
                release()
        return out

    # -- zero-copy ----------------------------------------------------------------------------------
    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Make ``size`` bytes at ``buffer_ptr`` usable by the zero-copy calls."""
        return self._rc(lambda: self._c.register_buffer((int(buffer_ptr), int(size))) and None)

    def unregister_buffer(self, buffer_ptr: int) -> int:
        return self._rc(self._c.unregister_buffer if self._c else None, int(buffer_ptr))

    def _put_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int],
                  config: Any, upsert: bool) -> list[int]:
        keys = list(keys)
        if self._c is None:
            return [INVALID_PARAMS] * len(keys)
        if not len(keys) == len(ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        rc = check_config(config, len(keys), copying=True)
        if rc:
            return [rc] * len(keys)

        def call(idx: list[int], native: Any) -> list[int]:
            return self._each(self._c.batch_put_from, len(idx), [keys[i] for i in idx],
                              [int(ptrs[i]) for i in idx], [int(sizes[i]) for i in idx],
                              native, upsert)
        return self._grouped(config, len(keys), call)

    def _put_one(self, key: str, ptr: int, size: int, config: Any, upsert: bool) -> int:
        """``_put_from`` of one key (one config group), with less Python."""
        if self._c is None:
            return INVALID_PARAMS
        rc = check_config(config, 1, copying=True)
        if rc:
            return rc
        native = None if config is None else natives(config, 1)[0]
        return self._each(self._c.batch_put_from, 1, [key], [int(ptr)], [int(size)], native,
                          upsert)[0]

    def put_from(self, key: str, buffer_ptr: int, size: int,
                 config: ReplicateConfig | None = None) -> int:
        return self._put_one(key, buffer_ptr, size, config, False)

    def upsert_from(self, key: str, buffer_ptr: int, size: int,
                    config: ReplicateConfig | None = None) -> int:
        return self._put_one(key, buffer_ptr, size, config, True)

    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                       sizes: Sequence[int], config: ReplicateConfig | None = None) -> list[int]:
        return self._put_from(keys, buffer_ptrs, sizes, config, False)

    def batch_upsert_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                          sizes: Sequence[int], config: ReplicateConfig | None = None) -> list[int]:
        return self._put_from(keys, buffer_ptrs, sizes, config, True)

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Read ``key`` into registered memory; the bytes read or a negative code."""
        if self._c is None:
            return INVALID_PARAMS
        try:
            return self._c.get_into(key, int(buffer_ptr), int(size))
        except KVPlaneError as exc:  # a miss is no warning: the batch form logs none either
            return code_of(exc)

    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                       sizes: Sequence[int]) -> list[int]:
        keys = list(keys)
        if self._c is None or not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        return self._each(self._c.batch_get_into, len(keys), keys,
                          [int(p) for p in buffer_ptrs], [int(s) for s in sizes])

    def batch_put_from_multi_buffers(self, keys: Sequence[str],
                                     all_buffer_ptrs: Sequence[Sequence[int]],
                                     all_sizes: Sequence[Sequence[int]],
                                     config: ReplicateConfig | None = None) -> list[int]:
        """One object per key, gathered from several registered fragments (in order)."""
        keys = list(keys)
        if self._c is None or not len(keys) == len(all_buffer_ptrs) == len(all_sizes):
            return [INVALID_PARAMS] * len(keys)
        rc = check_config(config, len(keys))
        if rc:
            return [rc] * len(keys)
        out = []
        for i, key in enumerate(keys):
            out.append(self._gather_put(key, all_buffer_ptrs[i], all_sizes[i], config, i))
        return out

    def _gather_put(self, key: str, ptrs: Sequence[int], sizes: Sequence[int], config: Any,
                    index: int) -> int:
        if len(ptrs) != len(sizes):
            return INVALID_PARAMS
        total = sum(int(s) for s in sizes)
        native = natives(config, index + 1)[index] if config is not None else None
        try:
            with self._c.staging.block(total) as (addr, view):
                off = 0
                for p, n in zip(ptrs, sizes):
                    view[off:off + int(n)] = np.frombuffer(self._view(p, n), np.uint8)
                    off += int(n)
                return self._rc(self._c.put_from, key, addr, total, native)
        except KVPlaneError as exc:
            return code_of(exc)

    def batch_get_into_multi_buffers(self, keys: Sequence[str],
                                     all_buffer_ptrs: Sequence[Sequence[int]],
                                     all_sizes: Sequence[Sequence[int]],
                                     prefer_alloc_in_same_node: bool = False) -> list[int]:
        """Scatter each object over its registered fragments; bytes read or a negative code."""
        keys = list(keys)
        if self._c is None or not len(keys) == len(all_buffer_ptrs) == len(all_sizes):
            return [INVALID_PARAMS] * len(keys)
        return [self._scatter_get(k, p, s) for k, p, s in zip(keys, all_buffer_ptrs, all_sizes)]

    def _scatter_get(self, key: str, ptrs: Sequence[int], sizes: Sequence[int]) -> int:
        if len(ptrs) != len(sizes):
            return INVALID_PARAMS
        total = sum(int(s) for s in sizes)
        try:
            with self._c.staging.block(total) as (addr, view):
                n = self._rc(self._c.get_into, key, addr, total)
                if n > 0:
                    off = 0
                    for p, k in zip(ptrs, sizes):
                        take = max(0, min(int(k), n - off))
                        self._view(p, take)[:] = view[off:off + take].data
                        off += take
                return n
        except KVPlaneError as exc:
            return code_of(exc)

    # -- existence, size, removal -------------------------------------------------------------------
    def is_exist(self, key: str) -> int:
        """1 present, 0 absent, a negative code on error."""
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        keys = list(keys)
        found = self._rc(self._c.batch_exists if self._c else None, keys)
        if isinstance(found, int):
            return [found] * len(keys)
        return [int(f) for f in found]

    def get_size(self, key: str) -> int:
        """Bytes of the object, or a negative code (-704 missing)."""
        return self._rc(self._c.get_size if self._c else None, key)

    def remove(self, key: str, force: bool = False) -> int:
        """0, -704 missing, -706 leased (``force`` ignores leases)."""
        return self._rc(self._c.remove if self._c else None, key, bool(force))

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        keys = list(keys)
        if self._c is None:
            return [INVALID_PARAMS] * len(keys)
        return self._each(self._c.batch_remove, len(keys), keys, bool(force))

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """How many keys matching ``regex_pattern`` went, or a negative code (-600 bad regex)."""
        try:
            re.compile(regex_pattern)
        except re.error:
            return INVALID_PARAMS
        return self._rc(self._c.remove_by_regex if self._c else None, regex_pattern,
                        bool(force))

    def remove_all(self, force: bool = False) -> int:
        """How many objects went (leased ones stay unless ``force``)."""
        return self._rc(self._c.remove_all if self._c else None, bool(force))

    def get_offload_rpc_read_count(self) -> int:
        """Reads served from an SSD tier through the owner's RPC: 0 (no SSD tier yet)."""
        return 0

    def __enter__(self) -> MooncakeDistributedStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
