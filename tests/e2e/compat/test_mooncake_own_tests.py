"""Mooncake's own Python store and transfer-engine tests, unchanged, against kvplane.

Runs ``tests/data/mooncake_peer/run_mooncake_tests.py`` on the Mooncake checkout that
``KVPLANE_MOONCAKE_SRC`` points at (skipped, with that reason, when it is not set). The suites
expected to pass here must pass; the ones with known gaps are listed in docs/store.md and only
reported.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

SRC = os.environ.get("KVPLANE_MOONCAKE_SRC", "")  # read at collection: the env fixture clears it
RUNNER = pathlib.Path(__file__).resolve().parents[2] / "data/mooncake_peer/run_mooncake_tests.py"
MUST_PASS = ["transfer_engine", "import_structure", "mooncake_config", "distributed_object_store",
             "replicated_object_store", "buffer_pool", "put_get_tensor", "safetensor_functions",
             "dummy_client", "multi_dummy_clients", "tensor_api", "async_store", "copy_move_api",
             "upsert_api", "session_ranges_e2e"]

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(3600),
              pytest.mark.skipif(not SRC, reason="set KVPLANE_MOONCAKE_SRC to a Mooncake checkout "
                                                 "(git clone https://github.com/kvcache-ai/Mooncake)")]


def test_mooncakes_own_python_tests_pass_on_kvplane(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, str(RUNNER), "--mooncake-src", SRC, "--out", str(out),
                           "--workdir", str(tmp_path / "logs")], capture_output=True, text=True,
                          timeout=3500, check=False)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    suites = {s["suite"]: s for s in json.loads(out.read_text())["suites"]}
    failed = {n: [c["test"] for c in suites[n]["cases"] if c["status"] in ("failed", "error")]
              for n in MUST_PASS if n in suites and suites[n]["status"] != "passed"}
    assert not failed, proc.stdout[-4000:]
