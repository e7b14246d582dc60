"""The SGLang HiCache and LMCache backends on a pool in (stand-in) device memory, in real
processes under the engines venv: pages and chunks stored from one process's device pool arrive
byte for byte in another's, moved by address through host staging (the device address is never
registered as host memory); a failing device copy is a miss or a failed store, never wrong
bytes. The store's master and pool run here, over sockets."""

from __future__ import annotations

import hashlib
import json
import subprocess
from typing import Any

import pytest

from kvplane.store import MasterServer, StoreClient
from tests.support.engines_harness import ENGINES_PYTHON, ROOT, engines_env

pytestmark = [pytest.mark.requires("engines"), pytest.mark.timeout(300)]
PART = 4 * 2 * 2 * 8 * 4  # device_backends_proc: one K or V region of a page
CHUNK = 2 * 2 * 8 * 2 * 8 * 4  # one LMCache chunk


@pytest.fixture(scope="module")
def master():
    with MasterServer(admin_port=None) as m:
        addr = f"127.0.0.1:{m.port}"
        with StoreClient(master=addr, protocol="tcp", global_segment_size=16 << 20):
            yield addr


def drive(**req: Any) -> dict[str, Any]:
    proc = subprocess.run([ENGINES_PYTHON, "-m", "tests.support.device_backends_proc",
                           json.dumps(req)], cwd=ROOT, env=engines_env("none"),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def seeded(seed: str, n: int, size: int) -> list[str]:
    return [hashlib.sha256(hashlib.shake_256(f"{seed}/{i}".encode()).digest(size)).hexdigest()
            for i in range(n)]


def test_sglang_pages_from_a_device_pool_arrive_in_another(master):
    saved = drive(engine="sglang", op="save", master=master, pages=[3, 5, 1], seed="sg")
    assert saved["ok"] == [True] * 3 and saved["to_host"] >= 1
    assert saved["parts"] == seeded("sg", 6, PART)
    got = drive(engine="sglang", op="load", master=master, pages=[7, 8, 9], seed="sg")
    assert got["ok"] == [True] * 3 and got["to_device"] >= 1
    assert got["parts"] == seeded("sg", 6, PART)


def test_sglang_failed_device_copies_are_misses_and_failed_stores(master):
    drive(engine="sglang", op="save", master=master, pages=[0, 1], seed="sg-f")
    got = drive(engine="sglang", op="load", master=master, pages=[4, 5], seed="sg-f",
                fail_to_device=1)
    assert got["ok"] == [False, False]
    assert got["parts"] == [hashlib.sha256(bytes(PART)).hexdigest()] * 4  # untouched
    bad = drive(engine="sglang", op="save", master=master, pages=[2], seed="sg-f2",
                fail_to_host=1)
    assert bad["ok"] == [False]
    assert drive(engine="sglang", op="load", master=master, pages=[6], seed="sg-f2")["ok"] == [False]


def test_lmcache_chunks_from_a_device_allocator_arrive_in_another(master):
    saved = drive(engine="lmcache", op="save", master=master, chunks=3, seed="lm")
    assert saved["hits"] == 3 and saved["put_failures"] == 0 and saved["to_host"] == 2  # 2 slots
    assert saved["chunks"] == seeded("lm", 3, CHUNK)
    got = drive(engine="lmcache", op="load", master=master, chunks=3, seed="lm")
    assert got["hits"] == 3 and got["chunks"] == seeded("lm", 3, CHUNK)


def test_lmcache_failed_device_copies_are_misses_and_failed_puts(master):
    drive(engine="lmcache", op="save", master=master, chunks=3, seed="lm-f")
    got = drive(engine="lmcache", op="load", master=master, chunks=3, seed="lm-f",
                fail_to_device=1)  # the first batch (two chunks) fails
    assert got["chunks"][:2] == [None, None] and got["chunks"][2] == seeded("lm-f", 3, CHUNK)[2]
    bad = drive(engine="lmcache", op="save", master=master, chunks=2, seed="lm-f2",
                fail_to_host=1)
    assert bad["put_failures"] == 2 and bad["hits"] == 0
