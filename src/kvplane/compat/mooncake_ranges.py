"""``MooncakeDistributedStore``'s ranged calls: ``get_into_ranges``, the get/put sessions
(``batch_get_session_start`` ... ``batch_put_session_revoke``) and ``put_from_with_metadata``.

A get session caches each key's replicas and read lease from one master round trip; its range
reads make no master call and fail with LEASE_EXPIRED (-707) once the lease is over. A put
session reserves the objects (PutStart); range writes go to every replica; ``end`` makes them
readable, ``revoke`` frees them. Buffers must be registered (``register_buffer`` or this
client's local buffer): an unregistered range is INVALID_PARAMS (-600).

A mixin of ``mooncake_store.MooncakeDistributedStore``; imports ``kvplane.store`` only.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from kvplane.common.errors import KVPlaneError
from kvplane.compat.mooncake_types import (
    INVALID_PARAMS,
    OBJECT_NOT_FOUND,
    OK,
    check_config,
    code_of,
    natives,
)
from kvplane.store.client.ranges import Ranges
from kvplane.store.types import KeyResult

log = logging.getLogger(__name__)


class RangesMixin:
    """See the module docstring."""

    _c: Any

    def __init__(self) -> None:
        self._ranges: Ranges | None = None
        self._get_sessions: dict[str, tuple[KeyResult, float]] = {}
        self._put_sessions: dict[str, KeyResult] = {}
        self._session_lock = threading.Lock()

    def _close(self) -> None:
        with self._session_lock:
            self._get_sessions.clear()
            self._put_sessions.clear()
        self._ranges = None

    def _range_io(self) -> Ranges:
        if self._ranges is None:
            self._ranges = self._c.ranges() if hasattr(self._c, "ranges") else Ranges(self._c)
        return self._ranges

    def _registered(self, addr: int, size: int) -> bool:
        try:
            self._c.engine.memory.find(int(addr), int(size))
        except KVPlaneError:
            return False
        return True

    # -- get_into_ranges -------------------------------------------------------------------------
    def get_into_ranges(self, buffer_ptrs: Sequence[int], all_keys: Sequence[Sequence[str]],
                        all_dst_offsets: Sequence[Sequence[Sequence[int]]],
                        all_src_offsets: Sequence[Sequence[Sequence[int]]],
                        all_sizes: Sequence[Sequence[Sequence[int]]]) -> list[list[list[int]]]:
        """Buffer-major gather: ``results[i][j][k]`` = bytes of fragment k of key j read into
        buffer i, or a negative code (shapes as in Mooncake's docs)."""
        shape = [[len(all_sizes[i][j]) if i < len(all_sizes) and j < len(all_sizes[i]) else 1
                  for j in range(len(keys))] for i, keys in enumerate(all_keys)]
        bad = [[[INVALID_PARAMS] * n for n in row] for row in shape]
        if self._c is None or not (len(buffer_ptrs) == len(all_keys) == len(all_dst_offsets)
                                   == len(all_src_offsets) == len(all_sizes)):
            return bad
        distinct = sorted({k for keys in all_keys for k in keys})
        try:
            results, lease_end = self._range_io().lookup(distinct)
        except KVPlaneError as exc:
            code = code_of(exc)
            return [[[code] * n for n in row] for row in shape]
        by_key = dict(zip(distinct, results))
        out = bad
        for i, keys in enumerate(all_keys):
            if not (len(keys) == len(all_dst_offsets[i]) == len(all_src_offsets[i])
                    == len(all_sizes[i])):
                continue
            for j, key in enumerate(keys):
                out[i][j] = self._fragments(by_key[key], int(buffer_ptrs[i]), all_dst_offsets[i][j],
                                            all_src_offsets[i][j], all_sizes[i][j], lease_end)
        return out

    def _fragments(self, result: KeyResult, base: int, dsts: Sequence[int], srcs: Sequence[int],
                   sizes: Sequence[int], lease_end: float) -> list[int]:
        if not len(dsts) == len(srcs) == len(sizes):
            return [INVALID_PARAMS] * max(len(sizes), 1)
        if result.code:
            return [result.code] * len(sizes)
        ranges, out = [], [INVALID_PARAMS] * len(sizes)
        where = []
        for k, (d, s, n) in enumerate(zip(dsts, srcs, sizes)):
            if int(d) >= 0 and self._registered(base + int(d), int(n)):
                ranges.append((int(s), base + int(d), int(n)))
                where.append(k)
        for k, rc in zip(where, self._range_io().read(result, ranges, lease_end)):
            out[k] = rc
        return out

    # -- get sessions ---------------------------------------------------------------------------
    def batch_get_session_start(self, keys: Sequence[str]) -> list[int]:
        """Look the keys up once (replicas + lease); per key 0 or a negative code."""
        keys = list(keys)
        if self._c is None:
            return [INVALID_PARAMS] * len(keys)
        try:
            results, lease_end = self._range_io().lookup(keys)
        except KVPlaneError as exc:
            return [code_of(exc)] * len(keys)
        with self._session_lock:
            for key, r in zip(keys, results):
                if r.code == 0:
                    self._get_sessions[key] = (r, lease_end)
        return [r.code for r in results]

    def batch_get_into_multi_buffer_ranges(self, keys: Sequence[str],
                                           all_buffer_ptrs: Sequence[Sequence[int]],
                                           all_sizes: Sequence[Sequence[int]],
                                           all_src_offsets: Sequence[Sequence[int]]) -> list[int]:
        """Per key: object ranges into its buffers, no master call; total bytes or a code."""
        return [self._session_io(key, p, s, o, get=True)
                for key, p, s, o in self._zip(keys, all_buffer_ptrs, all_sizes, all_src_offsets)]

    def batch_get_session_end(self, keys: Sequence[str]) -> int:
        with self._session_lock:
            for key in keys:
                self._get_sessions.pop(key, None)
        return OK

    # -- put sessions ------------------------------------------------------------------------------
    def batch_put_session_start(self, keys: Sequence[str], sizes: Sequence[int],
                                config: Any = None) -> list[int]:
        """Reserve the objects (invisible until ``batch_put_session_end``)."""
        keys = list(keys)
        if self._c is None or len(keys) != len(sizes):
            return [INVALID_PARAMS] * len(keys)
        rc = check_config(config, len(keys))
        if rc:
            return [rc] * len(keys)
        with self._session_lock:
            todo = [i for i, k in enumerate(keys) if k not in self._put_sessions]
        out = [OK] * len(keys)
        cfgs = natives(config, len(keys))
        for native in {id(cfgs[i]): cfgs[i] for i in todo}.values():
            idx = [i for i in todo if cfgs[i] is native]
            try:
                results = self._range_io().reserve([keys[i] for i in idx],
                                                   [sizes[i] for i in idx], native)
            except KVPlaneError as exc:
                for i in idx:
                    out[i] = code_of(exc)
                continue
            with self._session_lock:
                for i, r in zip(idx, results):
                    out[i] = r.code
                    if r.code == 0:
                        self._put_sessions[keys[i]] = r
        return out

    def batch_put_from_multi_buffer_ranges(self, keys: Sequence[str],
                                           all_buffer_ptrs: Sequence[Sequence[int]],
                                           all_sizes: Sequence[Sequence[int]],
                                           all_dst_offsets: Sequence[Sequence[int]]) -> list[int]:
        """Per key: buffers into object ranges of its reservation; total bytes or a code."""
        return [self._session_io(key, p, s, o, get=False)
                for key, p, s, o in self._zip(keys, all_buffer_ptrs, all_sizes, all_dst_offsets)]

    def batch_put_session_end(self, keys: Sequence[str]) -> list[int]:
        return self._finish_puts(keys, commit=True)

    def batch_put_session_revoke(self, keys: Sequence[str]) -> list[int]:
        return self._finish_puts(keys, commit=False)

    def _finish_puts(self, keys: Sequence[str], commit: bool) -> list[int]:
        keys = list(keys)
        if self._c is None:
            return [INVALID_PARAMS] * len(keys)
        with self._session_lock:
            held = [(k, r) for k in keys
                    if (r := self._put_sessions.pop(k, None)) is not None]
        out = {k: OBJECT_NOT_FOUND for k in keys}
        if held:
            io = self._range_io()
            try:
                codes = io.commit(held) if commit else io.revoke(held)
            except KVPlaneError as exc:
                codes = [code_of(exc)] * len(held)
            out.update(zip([k for k, _ in held], codes))
        return [out[k] for k in keys]

    # -- shared ------------------------------------------------------------------------------------
    @staticmethod
    def _zip(keys: Sequence[str], *lists: Sequence[Any]) -> list[tuple[Any, ...]]:
        if any(len(x) != len(keys) for x in lists):
            return [(k, None, None, None) for k in keys]
        return list(zip(keys, *lists))

    def _session_io(self, key: str, ptrs: Any, sizes: Any, offsets: Any, get: bool) -> int:
        if self._c is None or ptrs is None or not len(ptrs) == len(sizes) == len(offsets):
            return INVALID_PARAMS
        with self._session_lock:
            held = self._get_sessions.get(key) if get else self._put_sessions.get(key)
        if held is None:
            return INVALID_PARAMS
        if any(not self._registered(p, n) for p, n in zip(ptrs, sizes)):
            return INVALID_PARAMS
        ranges = [(int(o), int(p), int(n)) for p, n, o in zip(ptrs, sizes, offsets)]
        io = self._range_io()
        codes = (io.read(held[0], ranges, held[1]) if get  # type: ignore[index]  # held is a pair on the read path
                 else io.write(held, ranges))  # type: ignore[arg-type]  # held is a handle on the write path
        bad = next((c for c in codes if c < 0), None)
        return bad if bad is not None else sum(codes)

    # -- metadata + data -----------------------------------------------------------------------------
    def put_from_with_metadata(self, key: str, buffer_ptr: int, metadata_buffer_ptr: int,
                               size: int, metadata_size: int, config: Any = None) -> int:
        """One object: ``metadata_size`` bytes at ``metadata_buffer_ptr`` then ``size`` bytes
        at ``buffer_ptr`` (both registered)."""
        return self.batch_put_from_multi_buffers(  # type: ignore[attr-defined]  # mixin: the store class has it
            [key], [[metadata_buffer_ptr, buffer_ptr]], [[metadata_size, size]], config)[0]
