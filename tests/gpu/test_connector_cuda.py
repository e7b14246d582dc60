"""The vLLM store connector's device path on real CUDA KV caches (skipped without a GPU): a
worker's caches in GPU memory, laid out as vLLM 0.32 allocates them, are saved through pinned
host staging into a real store and loaded, layer by layer, into another worker's caches;
block contents checksummed; the same as tests/integration/integrations/test_device_kv_store.py
on the stand-in device."""

from __future__ import annotations

import hashlib

import pytest

from kvplane.integrations.vllm.layout import worker_layout
from kvplane.integrations.vllm.plan import KeySpace, LoadJob, SaveJob
from kvplane.integrations.vllm.saver import BackgroundSaver
from kvplane.integrations.vllm.staged import StagedKV, open_staging
from kvplane.store import MasterServer, StoreClient

torch = pytest.importorskip("torch", reason="torch is not installed")
pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]
NAMES = ["layers.0.attn", "layers.1.attn", "layers.2.attn"]
BLOCKS, HEADS, BS, DIM = 64, 8, 16, 128  # 64 KiB pages (float32)


def cuda_caches(layout: str) -> dict[str, object]:
    """One allocation viewed as [B, H, N, C] per layer, strided as vLLM's allocate_kv_cache."""
    L, page = len(NAMES), HEADS * BS * DIM
    alloc = torch.zeros(L * BLOCKS * page, dtype=torch.float32, device="cuda:0")
    out = {}
    for i, name in enumerate(NAMES):
        off, bstride = (i * BLOCKS * page, page) if layout == "LBHNC" else (i * page, L * page)
        out[name] = alloc.as_strided((BLOCKS, HEADS, BS, DIM), (bstride, BS * DIM, DIM, 1), off)
    return out


def chain(n: int, seed: bytes) -> list[bytes]:
    out, h = [], seed
    for i in range(n):
        h = hashlib.sha256(h + bytes([i])).digest()
        out.append(h)
    return out


def block_digests(caches: dict[str, object], blocks: list[int]) -> list[str]:
    return [hashlib.sha256(caches[n][b].cpu().numpy().tobytes()).hexdigest()
            for b in blocks for n in NAMES]


@pytest.fixture
def master():
    with MasterServer(admin_port=None) as m:
        addr = f"127.0.0.1:{m.port}"
        with StoreClient(master=addr, protocol="tcp", global_segment_size=256 << 20):
            yield addr


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_cuda_kv_saved_by_one_worker_loads_into_another(master, layout):
    space = KeySpace("m", "float32", BS, len(NAMES))
    hashes = chain(6, layout.encode())
    src_c, dst_c = cuda_caches(layout), cuda_caches(layout)
    gen = torch.Generator(device="cuda:0").manual_seed(7)
    src = [3, 7, 1, 12, 9, 40]
    for n in NAMES:
        for b in src:
            src_c[n][b].copy_(torch.rand(HEADS, BS, DIM, generator=gen, device="cuda:0"))
    want = block_digests(src_c, src)
    ca = StoreClient(master=master, protocol="tcp", timeout=10.0)
    cb = StoreClient(master=master, protocol="tcp", timeout=10.0)
    try:
        la, lb = worker_layout(src_c, NAMES), worker_layout(dst_c, NAMES)
        sa = StagedKV(la, open_staging(la, ca.register_buffer, 8 << 20), 10.0, True)
        sb = StagedKV(lb, open_staging(lb, cb.register_buffer, 8 << 20), 10.0, True)
        saver = BackgroundSaver(ca.batch_put_from, 8)
        try:
            for layer in range(len(NAMES)):
                sa.save_layer(layer, [SaveJob("r", src, space.keys(hashes))])
            sa.submit_saves([SaveJob("r", src, space.keys(hashes))], saver)
            assert saver.drain(30) and saver.stats.failed == 0
        finally:
            saver.close()
        dst = [0, 5, 6, 2, 15, 63]
        assert sb.start_loads([LoadJob("q", dst, space.keys(hashes))], cb.batch_get_into) is None
        for layer in range(len(NAMES)):
            sb.wait_layer(layer)
        out = sb.finish_loads()
        assert out.failed == set() and out.loaded == len(dst)
        assert block_digests(dst_c, dst) == want
    finally:
        ca.close()
        cb.close()
