"""An SGLang HiCache instance driven with CPU tensors (runs in the engines venv; JSON lines).

``python -m tests.support.sglang_proc`` answers (see :mod:`tests.support.engine_lines`):

* ``store``: a fresh instance (SGLang's real ``HiCacheController`` over a CPU device pool, a
  host pool and the chosen storage backend) puts seeded KV for ``tokens`` into its host pool and
  backs it up to storage with ``write_storage``; it writes the KV it holds to ``out``.
* ``load``: a fresh instance (empty host pool) runs ``prefetch``: the controller's hit query
  (``batch_exists``) and its IO thread (``batch_get_v1``), with the hand-off HiRadixCache does in
  between (allocate host pages, queue the op); it writes the KV it received to ``out``.
* ``bench``: ``batch_set_v1`` / ``batch_exists`` / ``batch_get_v1`` of N pages on the backend
  alone, timed.

KV files hold the canonical layout ``[tokens, 2, layers, heads, head_dim]`` whatever the host
layout, so files from any two instances compare byte for byte (a token prefix is a byte prefix).
Why this level and not SGLang's server: docs/engines.md (the server's HiCache host pool needs
CUDA).

Test kit, not product.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE, HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str, hash_str_to_int64
from sglang.srt.runtime_context import get_parallel

from tests.support.engine_lines import clear_pool, serve, stage

GEOMETRY = {"page": 32, "heads": 2, "head_dim": 64, "layers": 2, "dtype": "float32",
            "tokens": 1024}
U64 = (1 << 64) - 1
HOST_BUDGET = 8 << 30
PARALLEL = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0)


class Instance:
    """One SGLang worker's cache stack: device pool, allocator, host pool, controller."""

    def __init__(self, backend: str, extra: dict[str, Any], layout: str, geometry: dict[str, Any],
                 controller: bool = True) -> None:
        g = {**GEOMETRY, **geometry}
        self.page, self.layers = g["page"], g["layers"]
        dtype = getattr(torch, g["dtype"])
        self.kv = MHATokenToKVPool(g["tokens"], self.page, dtype, g["heads"], g["head_dim"],
                                   self.layers, "cpu", False, v_head_dim=g["head_dim"],
                                   start_layer=0, end_layer=self.layers)
        # SGLang keeps a fixed reserve (10 GB) of host RAM free; a shared test box may not
        # have it, and these pools are small: give them a budget of their own.
        with host_memory_budget_scope(HOST_BUDGET):
            self.host = MHATokenToKVPoolHost(
                self.kv.get_device_pool_infos()[0].buffer_info, 2.0, 0, self.page, layout,
                pin_memory=False, device_capacity_tokens=self.kv.size, start_layer=0,
                end_layer=self.layers, write_back_staging=self.kv.hicache_write_back_staging,
                host_token_capacity=g.get("host_tokens"))
        self.ctrl: HiCacheController | None = None
        self.backend: Any = None
        with get_parallel().override(**PARALLEL):
            if controller:
                alloc = PagedTokenToKVPoolAllocator(g["tokens"], self.page, dtype, "cpu", self.kv,
                                                    need_sort=False)
                self.ctrl = HiCacheController(
                    alloc, self.host, self.page, dist.group.WORLD, threading.Event(),
                    write_policy="write_through", io_backend="direct", storage_backend=backend,
                    model_name="tiny", storage_backend_extra_config=dict(extra))
                self.backend = self.ctrl.storage_backend
            else:
                self.backend = StorageBackendFactory.create_backend(
                    backend, storage_config(extra, layout), self.host)
                self.backend.register_mem_pool_host(self.host)

    # -- the host pool in canonical form --------------------------------------------------------
    def canonical(self, idx: torch.Tensor) -> torch.Tensor:
        """The KV at token indices ``idx`` as ``[tokens, 2, layers, heads, head_dim]``."""
        buf = self.host.kv_buffer
        if self.host.layout == "page_first":
            return buf[:, idx].permute(1, 0, 2, 3, 4).contiguous()
        pages = idx[::self.page] // self.page
        part = buf[:, pages].permute(1, 3, 0, 2, 4, 5)
        return part.reshape(len(idx), 2, self.layers, *buf.shape[-2:]).contiguous()

    def set_canonical(self, idx: torch.Tensor, kv: torch.Tensor) -> None:
        buf = self.host.kv_buffer
        if self.host.layout == "page_first":
            buf[:, idx] = kv.permute(1, 0, 2, 3, 4)
            return
        pages = idx[::self.page] // self.page
        shaped = kv.reshape(len(pages), self.page, 2, self.layers, *buf.shape[-2:])
        buf[:, pages] = shaped.permute(2, 0, 3, 1, 4, 5)

    def random_kv(self, tokens: int, seed: int) -> torch.Tensor:
        shape = (tokens, 2, self.layers, *self.host.kv_buffer.shape[-2:])
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(self.host.dtype)

    def close(self) -> None:
        if self.ctrl is not None:
            self.ctrl.detach_storage_backend()
        elif self.backend is not None and hasattr(self.backend, "close"):
            self.backend.close()


def storage_config(extra: dict[str, Any], layout: str) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False,
        is_page_first_layout=layout.startswith("page_first"), model_name="tiny",
        extra_config=dict(extra))


def _write(path: str, kv: torch.Tensor) -> None:
    with open(path, "wb") as f:
        f.write(kv.contiguous().view(torch.uint8).numpy().tobytes())


def op_store(backend: str, extra: dict[str, Any], tokens: list[int], seed: int, out: str,
             layout: str = "page_first", geometry: dict[str, Any] | None = None,
             timeout: float = 60.0) -> dict[str, Any]:
    inst = Instance(backend, extra, layout, geometry or {})
    try:
        idx = inst.host.alloc(len(tokens))
        kv = inst.random_kv(len(tokens), seed)
        inst.set_canonical(idx, kv)
        hashes = get_storage_hash_str(tokens, None, page_size=inst.page)
        inst.ctrl.write_storage(idx, tokens, hash_value=hashes)
        ack = inst.ctrl.ack_backup_queue.get(timeout=timeout)
        _write(out, inst.canonical(idx))
        return {"stored_tokens": ack.completed_tokens, "page_hashes": hashes,
                "token_bytes": inst.host.get_size_per_token(),
                "event_hashes": [hash_str_to_int64(h) & U64 for h in hashes]}
    finally:
        inst.close()


def op_load(backend: str, extra: dict[str, Any], tokens: list[int], out: str,
            layout: str = "page_first", geometry: dict[str, Any] | None = None,
            announce: bool = False, timeout: float = 60.0) -> dict[str, Any]:
    inst = Instance(backend, extra, layout, geometry or {})
    try:
        op = inst.ctrl.prefetch(f"req-{uuid.uuid4().hex[:8]}", tokens)
        hit = inst.ctrl.prefetch_hit_queue.get(timeout=timeout)
        assert hit is op
        loaded = 0
        idx = torch.empty(0, dtype=torch.int64)
        if hit.storage_hit_count:
            idx = inst.host.alloc(hit.storage_hit_count)  # what HiRadixCache does on a hit
            inst.set_canonical(idx, torch.zeros_like(inst.canonical(idx)))
            hit.host_indices = idx
            if announce:
                stage("loading", hit_tokens=hit.storage_hit_count)
            inst.ctrl.prefetch_buffer.put(hit)
            loaded = _wait_prefetch(inst.ctrl, timeout)
        _write(out, inst.canonical(idx[:loaded]))
        return {"hit_tokens": hit.storage_hit_count, "loaded_tokens": loaded,
                "token_bytes": inst.host.get_size_per_token()}
    finally:
        inst.close()


def _wait_prefetch(ctrl: HiCacheController, timeout: float) -> int:
    done, deadline = 0, time.monotonic() + timeout
    while True:
        ack = ctrl.ack_prefetch_queue.get(timeout=max(0.1, deadline - time.monotonic()))
        if ack.completed_tokens is not None:
            done = max(done, ack.completed_tokens)
        if ack.completed_req:
            return done


def op_bench(backend: str, extra: dict[str, Any], pages: int, geometry: dict[str, Any],
             layout: str = "page_first", repeat: int = 3) -> dict[str, Any]:
    """Backend-level batch store / exists / load of ``pages`` pages, ``repeat`` times with
    fresh keys; returns seconds per run and whether every load was bit-exact."""
    g = {**GEOMETRY, **geometry}
    g["host_tokens"] = 2 * pages * g["page"]
    inst = Instance(backend, extra, layout, g, controller=False)
    try:
        _bench_once(inst, pages)  # warm-up, not counted: connections, first touches of memory
        runs = [_bench_once(inst, pages) for _ in range(repeat)]
    finally:
        inst.close()
    page_bytes = inst.host.get_size_per_token() * inst.page
    return {"runs": runs, "page_bytes": page_bytes, "pages": pages}


def _bench_once(inst: Instance, pages: int) -> dict[str, Any]:
    n = pages * inst.page
    src, dst = inst.host.alloc(n), inst.host.alloc(n)
    try:
        base = int.from_bytes(uuid.uuid4().bytes[:4], "big")
        hashes = get_storage_hash_str(list(range(base, base + n)), None, page_size=inst.page)
        inst.set_canonical(src, inst.random_kv(n, base))
        inst.set_canonical(dst, torch.zeros_like(inst.canonical(dst)))
        t = {"store": 0.0, "exists": 0.0, "load": 0.0}
        ok = {"store": True, "exists": True, "load": True}
        for i in range(0, pages, STORAGE_BATCH_SIZE):
            keys = hashes[i:i + STORAGE_BATCH_SIZE]
            sl = slice(i * inst.page, (i + len(keys)) * inst.page)
            ok["store"] &= _timed(t, "store", inst.backend.batch_set_v1, keys, src[sl]) is not None
        for i in range(0, pages, STORAGE_BATCH_SIZE):
            keys = hashes[i:i + STORAGE_BATCH_SIZE]
            ok["exists"] &= _timed(t, "exists", inst.backend.batch_exists, keys) == len(keys)
        for i in range(0, pages, STORAGE_BATCH_SIZE):
            keys = hashes[i:i + STORAGE_BATCH_SIZE]
            sl = slice(i * inst.page, (i + len(keys)) * inst.page)
            ok["load"] &= all(_timed(t, "load", inst.backend.batch_get_v1, keys, dst[sl]))
        exact = torch.equal(inst.canonical(src), inst.canonical(dst))
        clear_pool(inst.backend)  # untimed: the next run reuses the pool memory this one touched
        return {**t, "ok": all(ok.values()), "bit_exact": exact}
    finally:
        inst.host.free(src)
        inst.host.free(dst)


def _timed(acc: dict[str, float], name: str, fn: Any, *args: Any) -> Any:
    t0 = time.perf_counter()
    out = fn(*args)
    acc[name] += time.perf_counter() - t0
    return out


def _init_group() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


if __name__ == "__main__":
    _init_group()
    import sglang

    serve({"store": op_store, "load": op_load, "bench": op_bench},
          {"engine": "sglang", "version": sglang.__version__})
