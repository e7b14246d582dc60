"""MooncakeDistributedStore facade: Mooncake's names, argument order and return codes."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from kvplane.compat.mooncake import MooncakeDistributedStore, ReplicateConfig
from kvplane.store.master.server import MasterServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
BENCH_STORE = pathlib.Path(__file__).resolve().parents[2] / "data/mooncake_peer/bench_store.py"


@pytest.fixture(scope="module")
def master():
    with MasterServer(admin_port=None) as m:
        yield f"127.0.0.1:{m.port}"


def test_positional_setup_and_bytes_api(master):
    st = MooncakeDistributedStore()
    assert st.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", master) == 0
    try:
        assert st.put("k", b"value") == 0
        assert st.get("k") == b"value"
        assert st.get("missing") == b""  # Mooncake returns empty bytes on a miss
        assert st.is_exist("k") == 1 and st.is_exist("missing") == 0
        assert st.batch_is_exist(["k", "missing"]) == [1, 0]
        assert st.get_size("k") == 5 and st.get_size("missing") == -704
        assert st.put_batch(["a", "b"], [b"1", b"22"]) == 0
        assert st.get_batch(["a", "b", "c"]) == [b"1", b"22", b""]
        assert st.put_parts("parts", b"ab", memoryview(b"cd")) == 0 and st.get("parts") == b"abcd"
        assert st.upsert("k", b"new") == 0 and st.get("k") == b"new"
        assert st.remove("k") == -706  # leased by the get above
        assert st.remove("k", True) == 0 and st.remove("k") == -704
        cfg = ReplicateConfig()
        cfg.replica_num = 1
        cfg.with_hard_pin = True
        assert st.put("pinned", b"p", cfg) == 0
        assert st.remove_by_regex("^[ab]$", True) == 2
        assert st.health_check() == 0
        assert ":" in st.get_hostname()
    finally:
        assert st.close() == 0
    assert st.health_check() == 1


def test_dict_setup_and_zero_copy(master):
    st = MooncakeDistributedStore()
    assert st.setup({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                     "global_segment_size": 8 << 20, "local_buffer_size": 4 << 20,
                     "protocol": "tcp", "master_server_address": master}) == 0
    try:
        src = np.arange(1 << 20, dtype=np.uint8)
        dst = np.zeros(1 << 20, np.uint8)
        assert st.register_buffer(src.ctypes.data, src.nbytes) == 0
        assert st.register_buffer(dst.ctypes.data, dst.nbytes) == 0
        assert st.put_from("zc", src.ctypes.data, 4096) == 0
        assert st.get_into("zc", dst.ctypes.data, dst.nbytes) == 4096
        assert np.array_equal(dst[:4096], src[:4096])
        keys = ["m0", "m1"]
        assert st.batch_put_from(keys, [src.ctypes.data, src.ctypes.data + 8192], [100, 200]) == [0, 0]
        assert st.batch_get_into(keys + ["none"], [dst.ctypes.data] * 3, [1000] * 3) == [100, 200, -704]
        assert st.batch_put_from_multi_buffers(["mb"], [[src.ctypes.data, src.ctypes.data + 10]],
                                               [[10, 20]]) == [0]
        dst[:] = 0
        assert st.batch_get_into_multi_buffers(["mb"], [[dst.ctypes.data, dst.ctypes.data + 100]],
                                               [[15, 15]]) == [30]
        assert np.array_equal(dst[:15], src[:15]) and np.array_equal(dst[100:115], src[15:30])
        assert st.unregister_buffer(src.ctypes.data) == 0
    finally:
        st.close()


def test_setup_fails_cleanly_without_master():
    st = MooncakeDistributedStore()
    assert st.setup("127.0.0.1", "P2PHANDSHAKE", 0, 1 << 20, "tcp", "", "127.0.0.1:1") < 0


def test_mooncake_bench_store_runs_unchanged(master, tmp_path):
    env = dict(os.environ, BENCH_IMPL="kvplane")
    out = subprocess.run(
        [sys.executable, str(BENCH_STORE), "--master", master, "--metadata", "P2PHANDSHAKE",
         "--sizes", "4096,65536",
         "--batch", "4", "--duration", "0.1", "--cap-mb", "8", "--segment-mb", "64",
         "--local-buffer-mb", "32", "--out", str(tmp_path / "o.jsonl")],
        capture_output=True, text=True, timeout=170, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    gets = [r for r in rows if r.get("op", "").startswith("get") or "get" in r.get("op", "")]
    assert len(rows) >= 16 and gets
    assert all(r.get("verified", True) for r in rows)
