"""Drive ``KVPlaneStoreConnector``'s worker side the way vLLM's model runner does, on KV caches
in device memory (runs in the vLLM venv; one JSON request in argv, one JSON line out).

``python -m tests.support.vllm_connector_proc '{"op": "save", ...}'``:

* ``save``: a worker connector registers fresh caches, writes seeded bytes into ``blocks``, then
  runs one step whose plan saves them under the hash chain of ``seed`` (``save_kv_layer`` per
  layer, ``wait_for_save``) and steps until ``get_finished`` reports the request; answers the
  sha256 of every (block, layer) page and the saver's counters;
* ``load``: a worker connector registers zeroed caches and runs one step whose plan loads that
  chain into ``blocks`` (``start_load_kv``, ``wait_for_layer_load`` per layer, ``wait_for_save``,
  ``get_block_ids_with_load_errors``); answers the pages' sha256 and the failed block ids.

``device`` is ``standin`` (:mod:`tests.support.standin_device`; ``fail_to_device`` /
``fail_to_host`` batches fail) or a torch device (``cuda``, ``cpu``). ``layout`` is ``LBHNC`` or
``BLHNC``. The vLLM config is a namespace with the fields the connector reads.
Test kit, not product.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from types import SimpleNamespace as NS
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvplane.integrations.vllm.plan import LoadJob, SaveJob, StepPlan
from kvplane.integrations.vllm.store_connector import KVPlaneStoreConnector, KVPlaneStoreMetadata
from tests.support.standin_device import StandinDevice, vllm_caches

NAMES = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
GEOM = {"num_blocks": 32, "heads": 2, "block_size": 4, "head_dim": 16}


class TorchMemory:
    """Caches as torch tensors on ``device`` (one backing allocation, vLLM's strides)."""

    def __init__(self, device: str, layout: str) -> None:
        import torch
        self.torch = torch
        B, H, N, C = GEOM["num_blocks"], GEOM["heads"], GEOM["block_size"], GEOM["head_dim"]
        page, L = H * N * C, len(NAMES)
        self.backing = torch.zeros(L * B * page, dtype=torch.float32, device=device)
        self.caches = {}
        for i, name in enumerate(NAMES):
            off, bstride = (i * B * page, page) if layout == "LBHNC" else (i * page, L * page)
            self.caches[name] = self.backing.as_strided((B, H, N, C), (bstride, N * C, C, 1), off)
        self.raw = self.backing.view(torch.uint8)
        self.base = int(self.backing.data_ptr())

    def write(self, addr: int, data: bytes) -> None:
        src = self.torch.frombuffer(bytearray(data), dtype=self.torch.uint8)
        self.raw[addr - self.base:addr - self.base + len(data)].copy_(src)

    def digest(self, addr: int, n: int) -> str:
        part = self.raw[addr - self.base:addr - self.base + n].cpu().numpy().tobytes()
        return hashlib.sha256(part).hexdigest()


class StandinMemory:
    def __init__(self, req: dict[str, Any]) -> None:
        self.dev = StandinDevice("standin:0", lazy=True)
        self.dev.fail_to_device = int(req.get("fail_to_device", 0))
        self.dev.fail_to_host = int(req.get("fail_to_host", 0))
        self.caches = vllm_caches(self.dev, NAMES, layout=req.get("layout", "LBHNC"), **GEOM)
        self.write, self.digest = self.dev.write, self.dev.digest


def chain(n: int, seed: str) -> list[bytes]:
    out, h = [], seed.encode()
    for i in range(n):
        h = hashlib.sha256(h + bytes([i])).digest()
        out.append(h)
    return out


def vllm_config(extra: dict[str, Any]) -> NS:
    """The fields of vLLM's config a kvplane connector reads (TP 1, ``GEOM``'s block size)."""
    return NS(kv_transfer_config=NS(kv_connector_extra_config=extra, is_kv_consumer=True,
                                    is_kv_producer=True, kv_load_failure_policy="recompute",
                                    kv_role="kv_both"),
              cache_config=NS(cache_dtype="auto", block_size=GEOM["block_size"]),
              model_config=NS(dtype="torch.float32", model="/models/tiny"),
              parallel_config=NS(tensor_parallel_size=1))


def kv_cache_config() -> NS:
    return NS(kv_cache_groups=[NS(layer_names=list(NAMES))])


def connector(req: dict[str, Any]) -> KVPlaneStoreConnector:
    extra = {"master_server_address": req["master"], "protocol": "tcp", "timeout": 5.0,
             "layerwise_load": bool(req.get("layerwise_load", True)),
             "device_staging_size": req.get("staging", "1MiB")}
    return KVPlaneStoreConnector(vllm_config(extra), KVConnectorRole.WORKER, kv_cache_config())


def run(req: dict[str, Any]) -> dict[str, Any]:
    device = req.get("device", "standin")
    mem: Any = StandinMemory(req) if device == "standin" else TorchMemory(device, req["layout"])
    conn = connector(req)
    try:
        conn.register_kv_caches(mem.caches)
        layout = conn.kv_layout
        assert layout is not None
        blocks = list(req["blocks"])
        keys = conn.space.keys(chain(len(blocks), req["seed"]))
        addrs, sizes = layout.block_addrs(blocks)
        out: dict[str, Any] = {"device": layout.device}
        if req["op"] == "save":
            for i, (a, n) in enumerate(zip(addrs, sizes)):
                mem.write(a, hashlib.shake_256(f"{req['seed']}/{i}".encode()).digest(n))
            conn.bind_connector_metadata(KVPlaneStoreMetadata(StepPlan(saves=[
                SaveJob("req-save", blocks, keys)])))
            for name in NAMES:
                conn.save_kv_layer(name, mem.caches[name], None)
            conn.wait_for_save()
            conn.clear_connector_metadata()
            deadline = time.monotonic() + 20
            finished: set[str] = set()
            while "req-save" not in finished and time.monotonic() < deadline:
                done, _ = conn.get_finished({"req-save"} - finished)  # one engine step each
                finished |= done or set()
                time.sleep(0.01)
            out["finished"] = "req-save" in finished
            st = conn.save_stats
            assert st is not None
            out["saved"], out["failed"], out["dropped"] = st.saved, st.failed, st.dropped
        else:
            conn.bind_connector_metadata(KVPlaneStoreMetadata(StepPlan(loads=[
                LoadJob("req-load", blocks, keys)])))
            conn.start_load_kv(None)
            for name in NAMES:
                conn.wait_for_layer_load(name)
            conn.wait_for_save()
            out["errors"] = sorted(conn.get_block_ids_with_load_errors())
            conn.clear_connector_metadata()
            out["loaded"] = conn.loaded_blocks
        out["pages"] = [mem.digest(a, n) for a, n in zip(addrs, sizes)]
        out["piecewise"] = KVPlaneStoreConnector.requires_piecewise_for_cudagraph(
            {"layerwise_load": bool(req.get("layerwise_load", True))})
        return out
    finally:
        conn.shutdown()


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))), flush=True)
