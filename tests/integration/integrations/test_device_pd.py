"""KVPlanePDConnector on KV caches in device memory, in real processes: a prefill worker
connector holds seeded pages in stand-in "GPU" caches, a decode worker connector in another
process pulls them into other blocks of its own stand-in caches through the transfer engine
(the prefill's listener stages device -> host, the decoder host -> device), the pages' checksums
match and the prefill is released. A failing device copy on either side ends as failed blocks
(which vLLM recomputes), never as wrong bytes."""

from __future__ import annotations

import hashlib
import json
import subprocess

import pytest

from kvplane.common.procs import Proc
from tests.support.vllm_harness import ROOT, VLLM_PYTHON, vllm_env

pytestmark = [pytest.mark.requires("vllm"), pytest.mark.timeout(300)]
PAGE = 2 * 4 * 16 * 4  # heads x block x head_dim x float32


def prefill(**req) -> Proc:
    return Proc([VLLM_PYTHON, "-m", "tests.support.pd_connector_proc",
                 json.dumps({"role": "prefill", **req})], env=vllm_env(), ready_timeout=120)


def decode(p: Proc, **req) -> dict:
    body = {"role": "decode", "segment": p.info["segment"], "notify": p.info["notify"],
            "layers": p.info["layers"], **req}
    proc = subprocess.run([VLLM_PYTHON, "-m", "tests.support.pd_connector_proc", json.dumps(body)],
                          cwd=ROOT, env=vllm_env(), capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def released(p: Proc) -> bool:
    assert p.popen.stdout is not None
    line = p.popen.stdout.readline()
    return bool(json.loads(line)["released"])


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_decode_pulls_prefill_device_pages_through_staging(layout):
    p = prefill(blocks=[3, 9, 4], seed=f"pd-{layout}", layout=layout, hold_s=90)
    try:
        assert p.info["device"] == "standin:0"
        got = decode(p, blocks=[20, 1, 7], remote_blocks=[3, 9, 4], layout=layout)
        assert got["done"] and got["errors"] == [] and got["device"] == "standin:0"
        assert got["pages"] == p.info["pages"]  # (block, layer) pages, in order
        assert released(p)
    finally:
        p.stop()


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_a_failed_device_copy_is_failed_blocks_not_wrong_bytes(side):
    fail = {"fail_to_host": 1} if side == "prefill" else {}
    p = prefill(blocks=[3, 9], seed=f"pd-fail-{side}", hold_s=90, **fail)
    try:
        got = decode(p, blocks=[5, 6], remote_blocks=[3, 9],
                     **({"fail_to_device": 1} if side == "decode" else {}))
        assert got["done"] and got["errors"] == [5, 6]
        zero = hashlib.sha256(bytes(PAGE)).hexdigest()
        assert zero in got["pages"]  # at least one page never arrived: nothing claims it did
        assert released(p)  # a failed pull still releases the prefill's blocks
    finally:
        p.stop()
