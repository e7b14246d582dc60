"""Real vLLM CPU 0.32 instances sharing KV through kvplane's store (KVPlaneStoreConnector).

One master + one ``kvplane segment`` process hold the pool; engines A and B are separate vLLM
processes with the connector (kv_both). The engines are started once per module and reused by
the three checks, which use different prompts; the fault check kills the segment, so it runs last.
"""

from __future__ import annotations

import pathlib
import signal
import subprocess
import threading

import httpx
import numpy as np
import pytest
from vllm_harness import BS, Driver, max_diff, prompt, requires_vllm, store_kv_config

from kvplane.store.client.client import StoreClient
from kvplane.store.config import StoreConfig
from kvplane.transfer.memory import sweep_stale_shm
from tests.support.auth import headers
from tests.support.services import wait_until
from tests.support.store_procs import spawn_master, spawn_segment

pytestmark = [pytest.mark.e2e, requires_vllm, pytest.mark.timeout(240)]
LAYERS = 2
FULL_BLOCKS = 3  # 100-token prompts: blocks 0..2 are loadable, the 4-token tail is computed


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("vllm-pool")
    master = spawn_master()
    segment = spawn_segment(master.info["master"], "64MiB")
    cfg = {"model_dir": tiny_model, "kv_transfer_config": store_kv_config(master.info["master"])}
    a = Driver(tmp / "a.log", cfg)
    b = Driver(tmp / "b.log", cfg)
    try:
        a.expect("READY", 200)
        b.expect("READY", 200)
        yield {"master": master, "segment": segment, "a": a, "b": b,
               "admin": f"http://127.0.0.1:{master.info['admin_port']}"}
    finally:
        a.close()
        b.close()
        segment.kill()
        segment.stop()  # closes its pipes
        master.stop()
        sweep_stale_shm()  # the killed segment could not unlink its shared memory


def stored_keys(admin: str) -> set[str]:
    return set(httpx.get(f"{admin}/get_all_keys", timeout=5, trust_env=False,
                          headers=headers()).json())


def serve_on_a(pool, tokens: list[int]) -> tuple[dict, set[str]]:
    """A serves ``tokens`` (no cache anywhere yet); wait until its saves are in the store."""
    before = stored_keys(pool["admin"])
    ref = pool["a"].generate(tokens)
    assert ref["num_cached_tokens"] == 0
    want = FULL_BLOCKS * LAYERS
    wait_until(lambda: len(stored_keys(pool["admin"]) - before) >= want, 30, "A's saves")
    return ref, stored_keys(pool["admin"]) - before


@pytest.mark.timeout(300)
def test_fresh_instance_loads_prefix_from_pool_and_matches_no_cache_run(pool):
    tokens = prompt(1)
    ref, keys = serve_on_a(pool, tokens)
    assert len(keys) == FULL_BLOCKS * LAYERS
    out = pool["b"].generate(tokens)
    assert out["num_cached_tokens"] == FULL_BLOCKS * BS  # B's local cache was empty: all from kvplane
    assert "matched 96 tokens in the store" in pool["b"].log_text()
    assert out["tokens"] == ref["tokens"]
    assert max_diff(out["logprobs"], ref["logprobs"]) == 0.0


def test_corrupted_stored_kv_is_detected(pool):
    tokens = prompt(2)
    ref, keys = serve_on_a(pool, tokens)
    rng = np.random.default_rng(7)
    with StoreClient(StoreConfig(master=pool["master"].info["master"], protocol="tcp",
                                 local_buffer_size=1 << 20, timeout=5)) as c:
        for key in sorted(keys):
            size = c.get_size(key)
            assert size > 0
            c.upsert(key, rng.standard_normal(size // 4).astype(np.float32).tobytes())
    out = pool["b"].generate(tokens)
    assert out["num_cached_tokens"] == FULL_BLOCKS * BS
    assert max_diff(out["logprobs"], ref["logprobs"]) > 1e-3  # the check can fail


def _stalled_reads(port: int, pid: int) -> int:
    """Bytes sent to the segment (TCP ``port``, process ``pid``) that it has not read, stopped:
    B's pending read requests.

    Linux /proc/net/tcp{,6}: the owner's side of each connection shows its receive queue. A
    client on the segment's host reads over the segment's Unix socket (kvplane.common.local,
    named ``@kvplane-PID-...``): ``ss -x`` shows those connections' receive queues.
    """
    waiting = 0
    try:
        unix = subprocess.run(["ss", "-xHn"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        unix = ""
    for line in unix.splitlines():
        f = line.split()
        if len(f) >= 5 and f[:2] == ["u_str", "ESTAB"] and f[4].startswith(f"@kvplane-{pid}-"):
            waiting += int(f[2])
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = pathlib.Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            local_port = int(f[1].rsplit(":", 1)[1], 16)
            rx = int(f[4].split(":")[1], 16)
            if local_port == port and f[3] == "01":  # ESTABLISHED
                waiting += rx
    return waiting


def test_segment_killed_while_b_loads_recomputes_correctly(pool):
    tokens = prompt(3)
    ref, _ = serve_on_a(pool, tokens)
    seg = pool["segment"]
    seg_port = int(seg.info["segment"].rsplit(":", 1)[1])
    b = pool["b"]
    assert _stalled_reads(seg_port, seg.popen.pid) == 0
    seg.signal(signal.SIGSTOP)  # B's read reaches the segment and stalls there
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(b.generate(tokens, timeout=90)), daemon=True)
    t.start()
    try:
        wait_until(lambda: _stalled_reads(seg_port, seg.popen.pid) > 0 or not t.is_alive(), 60,
                   "B's read request waiting at the stopped segment")
        assert t.is_alive(), f"B answered without reading from the stopped segment: {result}"
    finally:
        seg.kill()  # kill -9 mid-load
    t.join(90)
    assert result, "B did not answer"
    assert result["tokens"] == ref["tokens"]
    assert max_diff(result["logprobs"], ref["logprobs"]) == 0.0
    log = b.log_text()
    assert "failed to load; vLLM recomputes them" in log
    assert "Recovered from KV load failure" in log
