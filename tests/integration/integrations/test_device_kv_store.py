"""The store connector's device path against a real store (master and clients over sockets):
KV caches on a stand-in device (memory the host cannot address) are saved from one worker's
``StagedKV`` and loaded into another's, layer by layer, block contents checksummed; a failing
device copy is a failed load or save, never wrong bytes. (Pure kvplane; vLLM's own calls into
the connector are tested in test_device_connectors.py.)"""

from __future__ import annotations

import hashlib

import pytest

from kvplane.common.errors import InvalidArgument
from kvplane.integrations.vllm.layout import KVLayout, worker_layout
from kvplane.integrations.vllm.plan import KeySpace, LoadJob, SaveJob
from kvplane.integrations.vllm.saver import BackgroundSaver
from kvplane.integrations.vllm.staged import StagedKV, open_staging
from kvplane.store import MasterServer, StoreClient
from tests.support.standin_device import StandinDevice, vllm_caches

pytestmark = pytest.mark.timeout(60)
NAMES = ["layers.0.attn", "layers.1.attn", "layers.2.attn"]
GEOM = {"num_blocks": 16, "heads": 2, "block_size": 4, "head_dim": 8}  # 256 B pages (float32)
PAGE = 2 * 4 * 8 * 4


@pytest.fixture
def master():
    with MasterServer(admin_port=None) as m:
        addr = f"127.0.0.1:{m.port}"
        with StoreClient(master=addr, protocol="tcp", global_segment_size=8 << 20):
            yield addr  # the pool lives in its own client, like a ``kvplane segment``


def worker(master: str, dev: StandinDevice, layout: str = "LBHNC", staging: int = 1 << 20,
           layerwise: bool = True) -> tuple[StoreClient, KVLayout, StagedKV]:
    client = StoreClient(master=master, protocol="tcp", timeout=5.0)
    lay = worker_layout(vllm_caches(dev, NAMES, layout=layout, **GEOM), NAMES)
    return client, lay, StagedKV(lay, open_staging(lay, client.register_buffer, staging), 5.0,
                                 layerwise)


def chain(n: int, seed: bytes) -> list[bytes]:
    out, h = [], seed
    for i in range(n):
        h = hashlib.sha256(h + bytes([i])).digest()
        out.append(h)
    return out


def fill(dev: StandinDevice, lay: KVLayout, blocks: list[int], seed: int) -> list[str]:
    addrs, sizes = lay.block_addrs(blocks)
    digests = []
    for i, (a, n) in enumerate(zip(addrs, sizes)):
        data = hashlib.shake_256(f"{seed}/{i}".encode()).digest(n)
        dev.write(a, data)
        digests.append(hashlib.sha256(data).hexdigest())
    return digests


def digests(dev: StandinDevice, lay: KVLayout, blocks: list[int]) -> list[str]:
    addrs, sizes = lay.block_addrs(blocks)
    return [dev.digest(a, n) for a, n in zip(addrs, sizes)]


def save(staged: StagedKV, client: StoreClient, jobs: list[SaveJob], layerwise: bool = True):
    saver = BackgroundSaver(client.batch_put_from, 8)
    try:
        if layerwise:  # vLLM's save_kv_layer after each layer, then wait_for_save
            for layer in range(len(NAMES)):
                staged.save_layer(layer, jobs)
        staged.submit_saves(jobs, saver)
        assert saver.drain(10)
        return saver.stats
    finally:
        saver.close()


def load(staged: StagedKV, client: StoreClient, jobs: list[LoadJob]):
    out = staged.start_loads(jobs, client.batch_get_into)
    assert out is None  # layer-wise: copies run until each layer is waited for
    for layer in range(len(NAMES)):
        staged.wait_layer(layer)
    return staged.finish_loads()


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_save_on_one_worker_load_into_another_layer_by_layer(master, layout):
    space = KeySpace("m", "float32", 4, len(NAMES))
    hashes = chain(5, layout.encode())
    a, b = StandinDevice("standin:0", lazy=True), StandinDevice("standin:1", lazy=True)
    ca, la, sa = worker(master, a, layout)
    cb, lb, sb = worker(master, b, layout)
    try:
        src = [3, 7, 1, 12, 9]
        want = fill(a, la, src, seed=1)
        stats = save(sa, ca, [SaveJob("r1", src[:2], space.keys(hashes[:2])),
                              SaveJob("r2", src[2:], space.keys(hashes[2:]))])
        assert (stats.saved, stats.failed, stats.dropped) == (15, 0, 0)
        assert a.batches["to_host"] >= len(NAMES)  # one batch per layer, at least
        assert sa.staging.saves.free == sa.staging.saves.count  # slots given back
        dst = [0, 5, 6, 2, 15]
        out = load(sb, cb, [LoadJob("q1", dst, space.keys(hashes))])
        assert out.failed == set() and out.loaded == 5
        assert digests(b, lb, dst) == want
        assert b.batches["to_device"] == len(NAMES)
        assert sb.staging.loads.free == sb.staging.loads.count
    finally:
        for c in (ca, cb):
            c.close()


def test_a_failing_device_copy_is_a_failed_load_not_wrong_bytes(master):
    space = KeySpace("m", "float32", 4, len(NAMES))
    hashes = chain(3, b"fail")
    a, b = StandinDevice("standin:0"), StandinDevice("standin:1", lazy=True)
    ca, la, sa = worker(master, a)
    cb, lb, sb = worker(master, b)
    try:
        fill(a, la, [0, 1, 2], seed=2)
        save(sa, ca, [SaveJob("r", [0, 1, 2], space.keys(hashes))])
        zero = digests(b, lb, [4, 5, 6])
        b.fail_to_device = 1  # layer 0's batch fails at its fence
        out = load(sb, cb, [LoadJob("q", [4, 5, 6], space.keys(hashes))])
        assert out.failed == {4, 5, 6} and out.loaded == 0
        b.fail_to_device, b.refuse = 1, True  # refused when started
        out = load(sb, cb, [LoadJob("q", [4, 5, 6], space.keys(hashes))])
        assert out.failed == {4, 5, 6}
        assert sb.staging.loads.free == sb.staging.loads.count
        b.refuse = False
        out = load(sb, cb, [LoadJob("q", [4, 5, 6], space.keys(hashes))])
        assert out.failed == set() and digests(b, lb, [4, 5, 6]) != zero
        missing = load(sb, cb, [LoadJob("q", [7], space.keys(chain(1, b"never")))])
        assert missing.failed == {7}
    finally:
        ca.close()
        cb.close()


def test_a_failing_device_copy_fails_the_save(master):
    space = KeySpace("m", "float32", 4, len(NAMES))
    hashes = chain(2, b"save-fail")
    a = StandinDevice("standin:0", lazy=True)
    ca, la, sa = worker(master, a)
    try:
        fill(a, la, [0, 1], seed=3)
        a.fail_to_host = 1
        stats = save(sa, ca, [SaveJob("r", [0, 1], space.keys(hashes))])
        assert stats.failed == 6 and stats.saved == 0
        assert not any(ca.batch_exists([k for ks in space.keys(hashes) for k in ks]))
        assert sa.staging.saves.free == sa.staging.saves.count
    finally:
        ca.close()


def test_loads_larger_than_the_staging_run_in_chunks_and_saves_beyond_it_are_dropped(master):
    space = KeySpace("m", "float32", 4, len(NAMES))
    hashes = chain(6, b"chunks")
    a, b = StandinDevice("standin:0"), StandinDevice("standin:1")
    small = 2 * 4 * PAGE  # four pages per half: a 6-block load (18 pages) runs in 5 chunks
    ca, la, sa = worker(master, a, staging=1 << 20)
    cb, lb, sb = worker(master, b, staging=small)
    try:
        want = fill(a, la, list(range(6)), seed=4)
        save(sa, ca, [SaveJob("r", list(range(6)), space.keys(hashes))], layerwise=False)
        out = sb.start_loads([LoadJob("q", list(range(10, 16)), space.keys(hashes))],
                             cb.batch_get_into)
        assert out is not None and out.failed == set() and out.loaded == 6  # complete at once
        assert digests(b, lb, list(range(10, 16))) == want
        assert b.batches["to_device"] == 5
        fill(b, lb, [0, 1], seed=5)
        saver = BackgroundSaver(cb.batch_put_from, 8)
        try:
            sb.submit_saves([SaveJob("big", [0, 1], space.keys(chain(2, b"big")))], saver)
            assert saver.drain(5) and saver.stats.dropped == 6 and saver.known("big")
        finally:
            saver.close()
    finally:
        ca.close()
        cb.close()


def test_staging_too_small_or_unknown_device_is_a_clear_error(master):
    dev = StandinDevice("standin:0")
    lay = worker_layout(vllm_caches(dev, NAMES, **GEOM), NAMES)
    with StoreClient(master=master, protocol="tcp") as client:
        with pytest.raises(InvalidArgument, match="device_staging_size"):
            open_staging(lay, client.register_buffer, PAGE)
        odd = StandinDevice("oddity:0")
        from kvplane.integrations.device_kv import register_device_kind
        register_device_kind("oddity", None)
        lay2 = worker_layout(vllm_caches(odd, NAMES, **GEOM), NAMES)
        with pytest.raises(InvalidArgument, match="no copy path"):
            open_staging(lay2, client.register_buffer, 1 << 20)
        # the engine itself never takes device memory as host memory
        with pytest.raises(InvalidArgument):
            lay.register(client.register_buffer)
