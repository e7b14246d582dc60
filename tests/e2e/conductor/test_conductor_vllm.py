"""Real vLLM CPU 0.32.0 -> KV events -> conductor -> /query (marked e2e).

Needs the venv made by .ci/setup-10-vllm-venv.sh (interpreter at $KVPLANE_VLLM_PYTHON, default
/opt/kvplane-vllm-venv/bin/python); skipped when it is absent.
"""

import json
import pathlib

import httpx
import pytest

from kvplane.conductor.config import ConductorConfig
from kvplane.conductor.server import ConductorServer
from tests.support.vllm_harness import Driver, vllm_env

DRIVER = pathlib.Path(__file__).with_name("vllm_driver.py")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(300),
    pytest.mark.requires("vllm"),
]
BS = 32
PROMPT = [(i * 37 + 11) % 1000 for i in range(100)]  # 3 complete blocks of 32 + 4 tokens


def start_driver(tmp: pathlib.Path, endpoint: str, topic: str) -> Driver:
    """The vLLM engine subprocess (vllm_driver.py), through the shared harness."""
    cfg = json.dumps({"model_dir": str(tmp / "model"), "endpoint": endpoint, "topic": topic})
    return Driver(tmp / "vllm.log", {}, env=vllm_env(OMP_NUM_THREADS="2"),
                  argv=[str(DRIVER), cfg])


def test_vllm_events_drive_conductor_queries(tmp_path):
    cfg = ConductorConfig(port=0, bind=("tcp://127.0.0.1:0",))
    with ConductorServer(cfg) as srv, httpx.Client(base_url=srv.url, timeout=10) as http:
        (endpoint,) = srv.zmq_endpoints
        r = http.post("/register", json={"instance_id": "vllm-0", "modelname": "tiny",
                                         "block_size": BS, "topic": "kv@vllm-0",
                                         "hash_profile": {"algorithm": "sha256",
                                                          "python_hash_seed": "0"}})
        assert r.status_code == 200, r.text
        stream = srv.conductor.stream("default", "vllm-0", 0)
        driver = start_driver(tmp_path, endpoint, "kv@vllm-0")
        try:
            driver.expect("READY", 200)
            query = {"model": "tiny", "token_ids": PROMPT, "block_size": BS}

            def matched() -> int:
                return http.post("/query", json=query).json()["default"]["vllm-0"]["longest_matched"]

            assert matched() == 0
            out = driver.call(60, op="generate", tokens=PROMPT)
            assert len(out) == 1
            assert srv.conductor.wait_until(lambda: stream.batches >= 1 and
                                            srv.conductor.health()["blocks"] >= 3, 30)
            res = http.post("/query", json=query).json()["default"]["vllm-0"]
            assert res == {"longest_matched": 96, "GPU": 96, "CPU": 96, "DISK": 96, "DP": {"0": 96}}
            (row,) = http.get("/instances").json()
            assert row["hash_status"] == "ok" and row["hash_checks"] >= 1  # our hashes == vLLM's
            other = {**query, "token_ids": [t + 1 for t in PROMPT]}
            assert http.post("/query", json=other).json()["default"]["vllm-0"]["longest_matched"] == 0

            assert driver.call(60, op="reset") is True
            assert srv.conductor.wait_until(lambda: srv.conductor.health()["blocks"] == 0, 30)
            assert matched() == 0
            assert srv.ingestor.stats.malformed == 0 and srv.ingestor.stats.unknown_stream == 0
        finally:
            driver.close()
