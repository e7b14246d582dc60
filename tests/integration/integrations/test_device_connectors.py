"""KVPlaneStoreConnector on KV caches in device memory, in real processes: a worker connector
(vLLM venv) saves stand-in "GPU" caches shaped as vLLM 0.32 lays them out, another process's
connector loads them into other blocks layer by layer, and the pages' checksums match; a failing
device copy comes back as failed blocks (``get_block_ids_with_load_errors``, which vLLM
recomputes), never as wrong bytes. The store's master and pool run here, over sockets."""

from __future__ import annotations

import hashlib
import json
import subprocess
from typing import Any

import pytest

from kvplane.store import MasterServer, StoreClient
from tests.support.vllm_harness import ROOT, VLLM_PYTHON, vllm_env

pytestmark = [pytest.mark.requires("vllm"), pytest.mark.timeout(300)]
LAYERS = 2


@pytest.fixture(scope="module")
def master():
    with MasterServer(admin_port=None) as m:
        addr = f"127.0.0.1:{m.port}"
        with StoreClient(master=addr, protocol="tcp", global_segment_size=16 << 20):
            yield addr


def drive(**req: Any) -> dict[str, Any]:
    """One connector process (the vLLM venv's interpreter); its JSON answer."""
    proc = subprocess.run([VLLM_PYTHON, "-m", "tests.support.vllm_connector_proc", json.dumps(req)],
                          cwd=ROOT, env=vllm_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def expected(seed: str, pages: int, page_bytes: int) -> list[str]:
    return [hashlib.sha256(hashlib.shake_256(f"{seed}/{i}".encode()).digest(page_bytes)).hexdigest()
            for i in range(pages)]


PAGE = 2 * 4 * 16 * 4  # heads x block x head_dim x float32


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_save_in_one_connector_load_into_another_on_standin_device(master, layout):
    seed = f"dev-{layout}"
    saved = drive(op="save", master=master, layout=layout, blocks=[5, 2, 9], seed=seed)
    want = expected(seed, 3 * LAYERS, PAGE)
    assert saved["device"] == "standin:0" and saved["finished"]
    assert (saved["saved"], saved["failed"], saved["dropped"]) == (6, 0, 0)
    assert saved["pages"] == want
    got = drive(op="load", master=master, layout=layout, blocks=[11, 3, 20], seed=seed)
    assert got["errors"] == [] and got["loaded"] == 3
    assert got["pages"] == want
    assert got["piecewise"]  # layer-wise loads need PIECEWISE CUDA graphs


def test_failed_device_copy_reports_failed_blocks_not_wrong_bytes(master):
    seed = "dev-fail"
    drive(op="save", master=master, layout="LBHNC", blocks=[1, 2], seed=seed)
    got = drive(op="load", master=master, layout="LBHNC", blocks=[7, 8], seed=seed,
                fail_to_device=1)
    assert got["errors"] == [7, 8] and got["loaded"] == 0
    zero = hashlib.sha256(bytes(PAGE)).hexdigest()
    # layer 0's copy failed: its pages stay untouched; layer 1's arrived (the blocks are failed)
    assert got["pages"][0::2] == [zero, zero]
    assert got["pages"][1::2] == expected(seed, 4, PAGE)[1::2]
    bad_save = drive(op="save", master=master, layout="LBHNC", blocks=[3], seed="dev-fail-save",
                     fail_to_host=1)
    assert bad_save["finished"] and bad_save["failed"] == 2 and bad_save["saved"] == 0
    miss = drive(op="load", master=master, layout="LBHNC", blocks=[4], seed="dev-fail-save")
    assert miss["errors"] == [4]
