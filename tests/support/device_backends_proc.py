"""Drive the SGLang HiCache and LMCache backends on a pool in (stand-in) device memory (runs in
the engines venv; one JSON request in argv, one JSON line out).

``python -m tests.support.device_backends_proc '{"engine": "sglang", "op": "save", ...}'``:

* ``sglang``: ``KVPlaneHiCacheStorage`` with SGLang's real ``HiCacheStorageConfig`` registers a
  page-first MHA pool whose ``kv_buffer`` lives on a stand-in device (``get_page_buffer_meta``
  as SGLang's page-first pool computes it: per page a K and a V region), then ``batch_set_v1`` of
  seeded ``pages`` or ``batch_get_v1`` into them; answers per-page results and part digests;
* ``lmcache``: ``KVPlaneConnector`` with a real ``LMCacheEngineConfig`` / ``LMCacheMetadata`` over
  a CPU backend whose allocator buffer lives on the stand-in device; ``batched_put`` of seeded
  chunks or ``batched_get`` (chunks allocated in that buffer); answers hits and digests.

``fail_to_device`` / ``fail_to_host`` make that many device copy batches fail.
Test kit, not product.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from types import SimpleNamespace as NS
from typing import Any

import torch

from tests.support.standin_device import StandinDevice

PAGE_TOKENS, HEADS, HEAD_DIM, LAYERS = 4, 2, 8, 2
PART = PAGE_TOKENS * LAYERS * HEADS * HEAD_DIM * 4  # one K (or V) region of a page, float32


def seeded(tag: str, n: int) -> bytes:
    return hashlib.shake_256(tag.encode()).digest(n)


def device(req: dict[str, Any]) -> StandinDevice:
    dev = StandinDevice("standin:0", lazy=True)
    dev.fail_to_device = int(req.get("fail_to_device", 0))
    dev.fail_to_host = int(req.get("fail_to_host", 0))
    return dev


class PagePool:
    """SGLang's page-first MHA host pool, its buffer on a stand-in device."""

    layout = "page_first"
    page_size = PAGE_TOKENS

    def __init__(self, dev: StandinDevice, pages: int) -> None:
        self.dev = dev
        addr = dev.alloc(pages * 2 * PART)
        self.kv_buffer = dev.tensor((pages * 2 * PART // 4,), (1,), 4, addr)
        self.kv_buffer.dtype = torch.float32
        self.base = addr

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        ptrs, sizes = [], []
        for tok in indices[::PAGE_TOKENS].tolist():
            page = int(tok) // PAGE_TOKENS
            ptrs += [self.base + page * 2 * PART, self.base + page * 2 * PART + PART]
            sizes += [PART, PART]
        return ptrs, sizes


def sglang(req: dict[str, Any]) -> dict[str, Any]:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from kvplane.integrations.sglang.hicache import KVPlaneHiCacheStorage

    dev = device(req)
    pool = PagePool(dev, 16)
    cfg = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="tiny", extra_config={"master_server_address": req["master"], "protocol": "tcp",
                                         "device_staging_size": req.get("staging", "64KiB")})
    storage = KVPlaneHiCacheStorage(cfg)
    try:
        storage.register_mem_pool_host(pool)
        pages = list(req["pages"])
        keys = [hashlib.sha256(f"{req['seed']}/{i}".encode()).hexdigest() for i in range(len(pages))]
        idx = torch.tensor([p * PAGE_TOKENS + t for p in pages for t in range(PAGE_TOKENS)])
        ptrs, sizes = pool.get_page_buffer_meta(idx)
        if req["op"] == "save":
            for i, (a, n) in enumerate(zip(ptrs, sizes)):
                dev.write(a, seeded(f"{req['seed']}/{i}", n))
            ok = storage.batch_set_v1(keys, idx)
        else:
            ok = storage.batch_get_v1(keys, idx)
        return {"ok": ok, "parts": [dev.digest(a, n) for a, n in zip(ptrs, sizes)],
                "to_host": dev.batches["to_host"], "to_device": dev.batches["to_device"]}
    finally:
        storage.close()


class Chunk:
    """A memory object inside the stand-in allocator buffer (what LMCache's allocator hands out)."""

    def __init__(self, addr: int, size: int) -> None:
        self.data_ptr, self._size, self.raw_tensor, self.released = addr, size, None, False

    def get_size(self) -> int:
        return self._size

    def ref_count_down(self) -> None:
        self.released = True


def lmcache(req: dict[str, Any]) -> dict[str, Any]:
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    from kvplane.integrations.lmcache.connector import KVPlaneConnector

    dev = device(req)
    chunk_tokens = 8
    meta = LMCacheMetadata(model_name="tiny", world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.float32, chunk_size=chunk_tokens,
                           kv_shape=(LAYERS, 2, chunk_tokens, HEADS, HEAD_DIM))
    size = LAYERS * 2 * chunk_tokens * HEADS * HEAD_DIM * 4
    slots = 8
    addr = dev.alloc(slots * size)
    buf = dev.tensor((slots * size // 4,), (1,), 4, addr)
    free = [addr + i * size for i in range(slots)]
    cfg = LMCacheEngineConfig.from_dict({
        "chunk_size": chunk_tokens, "local_cpu": False, "remote_serde": "naive",
        "extra_config": {"remote_storage_plugin.kvplane.protocol": "tcp",
                         "remote_storage_plugin.kvplane.device_staging_size": 4 * size}})
    backend = NS(config=cfg, metadata=meta,
                 memory_allocator=NS(pin_allocator=NS(buffer=buf)),
                 allocate=lambda *a, **k: Chunk(free.pop(0), size))
    loop = asyncio.new_event_loop()
    conn = KVPlaneConnector(loop, backend, cfg, url=f"kvplane://{req['master']}")
    try:
        chunks = list(range(int(req["chunks"])))
        keys = [CacheEngineKey("tiny", 1, 0, 1000 * len(req["seed"]) + i, torch.float32)
                for i in chunks]
        if req["op"] == "save":
            objs = [Chunk(free.pop(0), size) for _ in chunks]
            for i, o in enumerate(objs):
                dev.write(o.data_ptr, seeded(f"{req['seed']}/{i}", size))
            loop.run_until_complete(conn.batched_put(keys, objs))
            got: list[Any] = objs
            hits = conn.batched_contains(keys)
        else:
            got = loop.run_until_complete(conn.batched_get(keys))
            hits = sum(1 for o in got if o is not None)
        return {"hits": hits, "put_failures": conn.put_failures,
                "chunks": [dev.digest(o.data_ptr, size) if o is not None else None for o in got],
                "to_host": dev.batches["to_host"], "to_device": dev.batches["to_device"]}
    finally:
        loop.run_until_complete(conn.close())
        loop.close()


if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    answer = sglang(request) if request["engine"] == "sglang" else lmcache(request)
    print(json.dumps(answer), flush=True)
