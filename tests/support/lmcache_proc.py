"""An LMCache engine driven with CPU tensors (runs in the engines venv; JSON lines).

``python -m tests.support.lmcache_proc`` answers (see :mod:`tests.support.engine_lines`):

* ``store``: a fresh ``LMCacheEngine`` (LMCache's real token database, storage manager and
  remote backend, with the remote connector the config names) stores seeded KV for ``tokens``
  from a paged CPU KV cache through :class:`CpuKVConnector`, waits until ``lookup`` sees it in
  the remote store, and writes the KV it stored to ``out``;
* ``load``: a fresh engine (nothing local: ``local_cpu`` off) runs ``lookup`` and ``retrieve``
  into an empty paged KV cache and writes what it received to ``out``;
* ``list``: a fresh engine's remote connector ``list()`` (the chunk keys it finds in the store);
* ``bench``: the remote connector's ``batched_put`` / ``batched_contains`` / ``batched_get`` of
  N chunks, timed.

KV files hold ``[tokens, 2, layers, heads, head_dim]``, so files compare byte for byte (a token
prefix is a byte prefix). Why this
level and not vLLM + LMCache: docs/engines.md (LMCache has no CPU connector for vLLM).

Test kit, not product.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.metadata import LMCacheMetadata

from tests.support.engine_lines import clear_pool, serve, stage

GEOMETRY = {"chunk": 32, "heads": 2, "head_dim": 64, "layers": 2, "dtype": "float32",
            "slots": 1024}
U64 = (1 << 64) - 1


class CpuKVConnector(GPUConnectorInterface):
    """LMCache's KV-cache side on CPU: copies between memory objects (``KV_2LTD``:
    ``[2, layers, tokens, heads*head_dim]``) and a paged cache ``kvcaches`` of the same
    layout over ``slots``, addressed by ``slot_mapping``, as vLLM's paged connector does on GPU."""

    def __init__(self, layers: int, hidden: int) -> None:
        self.layers, self.hidden = layers, hidden

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.layers, num_tokens, self.hidden])

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        slots = kwargs["slot_mapping"][start:end]
        memory_obj.tensor.copy_(kwargs["kvcaches"][:, :, slots])

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        slots = kwargs["slot_mapping"][start:end]
        kwargs["kvcaches"][:, :, slots] = memory_obj.tensor

    def batched_from_gpu(self, memory_objs: Any, starts: list[int], ends: list[int],
                         **kwargs: Any) -> None:
        for obj, s, e in zip(memory_objs, starts, ends):
            self.from_gpu(obj, s, e, **kwargs)

    def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None, ends: Any = None,
                       **kwargs: Any) -> None:
        for obj, s, e in zip(memory_objs, starts, ends):
            self.to_gpu(obj, s, e, **kwargs)


class Instance:
    """One LMCache engine with a paged CPU KV cache."""

    def __init__(self, config: dict[str, Any], geometry: dict[str, Any]) -> None:
        g = {**GEOMETRY, **geometry}
        self.g = g
        self.dtype = getattr(torch, g["dtype"])
        cfg = LMCacheEngineConfig.from_dict({
            "chunk_size": g["chunk"], "local_cpu": False, "max_local_cpu_size": 0.2,
            "remote_serde": "naive", **config})
        meta = LMCacheMetadata(
            model_name="tiny", world_size=1, local_world_size=1, worker_id=0,
            local_worker_id=0, kv_dtype=self.dtype, chunk_size=g["chunk"],
            kv_shape=(g["layers"], 2, g["chunk"], g["heads"], g["head_dim"]))
        self.id = f"kvplane-{uuid.uuid4().hex[:8]}"
        self.hidden = g["heads"] * g["head_dim"]
        self.engine: LMCacheEngine = LMCacheEngineBuilder.get_or_create(
            self.id, cfg, meta, CpuKVConnector(g["layers"], self.hidden),
            lambda *a: None, lambda obj, *a: obj)
        self.engine.post_init()
        self.kv = torch.zeros(2, g["layers"], g["slots"], self.hidden, dtype=self.dtype)
        self.slots = torch.randperm(g["slots"], generator=torch.Generator().manual_seed(7))

    def canonical(self, n: int) -> torch.Tensor:
        """The KV of the first ``n`` tokens as ``[tokens, 2, layers, heads, head_dim]``."""
        kv = self.kv[:, :, self.slots[:n]].permute(2, 0, 1, 3)
        return kv.reshape(n, 2, self.g["layers"], self.g["heads"], self.g["head_dim"])

    def token_bytes(self) -> int:
        return 2 * self.g["layers"] * self.hidden * self.dtype.itemsize

    def chunk_keys(self, tokens: list[int]) -> list[CacheEngineKey]:
        return [k for _, _, k in self.engine.token_database.process_tokens(tokens=torch.tensor(tokens))]

    def remote(self) -> Any:
        sm = self.engine.storage_manager
        return next(b for name, b in sm.storage_backends.items() if name.startswith("RemoteBackend"))

    def close(self) -> None:
        LMCacheEngineBuilder.destroy(self.id)


def _write(path: str, kv: torch.Tensor) -> None:
    with open(path, "wb") as f:
        f.write(kv.contiguous().view(torch.uint8).numpy().tobytes())


def op_store(config: dict[str, Any], tokens: list[int], seed: int, out: str,
             geometry: dict[str, Any] | None = None, timeout: float = 60.0) -> dict[str, Any]:
    inst = Instance(config, geometry or {})
    try:
        n = len(tokens)
        gen = torch.Generator().manual_seed(seed)
        inst.kv[:, :, inst.slots[:n]] = torch.randn(
            2, inst.g["layers"], n, inst.hidden, generator=gen).to(inst.dtype)
        toks = torch.tensor(tokens)
        inst.engine.store(toks, kvcaches=inst.kv, slot_mapping=inst.slots[:n])
        want = n - n % inst.g["chunk"]
        deadline = time.monotonic() + timeout
        while (seen := inst.engine.lookup(toks)) < want and time.monotonic() < deadline:
            threading.Event().wait(0.05)  # the remote put runs on LMCache's loop
        keys = inst.chunk_keys(tokens)
        _write(out, inst.canonical(n))
        return {"stored_tokens": seen, "keys": [k.to_string() for k in keys],
                "token_bytes": inst.token_bytes(),
                "event_hashes": [_event(k.chunk_hash) for k in keys]}
    finally:
        inst.close()


def _event(chunk_hash: int | bytes) -> int:
    if isinstance(chunk_hash, bytes):
        return int.from_bytes(chunk_hash[-8:], "big")
    return chunk_hash & U64


def op_load(config: dict[str, Any], tokens: list[int], out: str,
            geometry: dict[str, Any] | None = None, announce: bool = False) -> dict[str, Any]:
    inst = Instance(config, geometry or {})
    try:
        toks = torch.tensor(tokens)
        hit = inst.engine.lookup(toks)
        if announce:
            stage("loading", hit_tokens=hit)
        mask = inst.engine.retrieve(toks, kvcaches=inst.kv, slot_mapping=inst.slots[:len(tokens)])
        flags = mask.tolist()
        loaded = flags.index(False) if False in flags else len(flags)
        _write(out, inst.canonical(loaded))
        return {"hit_tokens": hit, "loaded_tokens": loaded, "retrieved": int(mask.sum()),
                "token_bytes": inst.token_bytes()}
    finally:
        inst.close()


def op_list(config: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
    inst = Instance(config, {})
    try:
        backend = inst.remote()
        keys = asyncio.run_coroutine_threadsafe(backend.connection.list(), backend.loop)
        return {"keys": keys.result(timeout)}
    finally:
        inst.close()


def op_bench(config: dict[str, Any], chunks: int, geometry: dict[str, Any],
             repeat: int = 3) -> dict[str, Any]:
    """Remote-connector batched put / contains / get of ``chunks`` full chunks, ``repeat``
    times with fresh keys; seconds per run and whether every get was bit-exact."""
    inst = Instance(config, geometry)
    try:
        backend = inst.remote()
        wrapped = backend.connection.getWrappedConnector()
        region = getattr(wrapped, "_region", None)  # kvplane's connector: registered allocator
        _bench_once(inst, backend, chunks)  # warm-up, not counted: connections, first touches
        runs = [_bench_once(inst, backend, chunks) for _ in range(repeat)]
    finally:
        inst.close()
    chunk_bytes = inst.g["chunk"] * inst.token_bytes()
    return {"runs": runs, "chunk_bytes": chunk_bytes, "chunks": chunks,
            "connector": type(wrapped).__name__, "zero_copy_region": region}


def _bench_once(inst: Instance, backend: Any, chunks: int) -> dict[str, Any]:
    base = int.from_bytes(uuid.uuid4().bytes[:6], "big")
    keys = [CacheEngineKey("tiny", 1, 0, base + i, inst.dtype) for i in range(chunks)]
    sm, conn, loop = inst.engine.storage_manager, backend.connection, backend.loop
    objs = [sm.allocate(inst.engine.metadata.get_shapes(), inst.engine.metadata.get_dtypes())
            for _ in keys]
    refs = []
    for i, obj in enumerate(objs):
        gen = torch.Generator().manual_seed(base + i)
        obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=gen).to(inst.dtype))
        refs.append(obj.tensor.clone())
        obj.ref_count_up()  # the connector's wrapper releases one reference per put
    t = {}
    t0 = time.perf_counter()
    asyncio.run_coroutine_threadsafe(conn.batched_put(keys, objs), loop).result(600)
    t["store"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    present = backend.batched_contains(keys)
    t["exists"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = asyncio.run_coroutine_threadsafe(conn.batched_get(keys), loop).result(600)
    t["load"] = time.perf_counter() - t0
    exact = all(g is not None and torch.equal(g.tensor, r) for g, r in zip(got, refs))
    for obj in [*objs, *(g for g in got if g is not None)]:
        obj.ref_count_down()
    clear_pool(conn.getWrappedConnector())  # untimed: the next run reuses the touched memory
    return {**t, "ok": present == chunks and all(g is not None for g in got), "bit_exact": exact}


if __name__ == "__main__":
    import lmcache

    serve({"store": op_store, "load": op_load, "list": op_list, "bench": op_bench},
          {"engine": "lmcache", "version": getattr(lmcache, "__version__", "?")})
