"""kvplane's block hashes (batched path included) against vLLM 0.32's own hash_block_tokens.

Runs vLLM's hashing in its venv on long chains that use every token size class and the block
sizes where pickle and CBOR change their tuple/array heads; skipped when the venv is absent.
"""

import json
import random
import subprocess

import pytest

from kvplane.conductor.hashing import HashProfile
from tests.support.vllm_harness import VLLM_PYTHON, vllm_env

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(180),
    pytest.mark.requires("vllm"),
]

VLLM_SIDE = r"""
import json, sys
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash
cases = json.load(sys.stdin)
out = {}
for algo in ("sha256", "sha256_cbor"):
    fn = get_hash_fn_by_name(algo)
    init_none_hash(fn)
    for bs, toks in cases:
        parent, hs = None, []
        for i in range(len(toks) // bs):
            parent = hash_block_tokens(fn, parent, toks[i * bs:(i + 1) * bs], None)
            hs.append(int.from_bytes(bytes(parent)[-8:], "big"))
        out[f"{algo}/{bs}"] = hs
json.dump(out, sys.stdout)
"""


def test_event_hashes_equal_vllm_hash_block_tokens():
    rng = random.Random(7)
    classes = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1]
    cases = [(bs, [rng.choice(classes) if rng.random() < 0.3 else rng.randrange(200_000)
                   for _ in range(bs * 600 + 1)]) for bs in (1, 3, 4, 16, 24, 256)]
    proc = subprocess.run([VLLM_PYTHON, "-c", VLLM_SIDE], input=json.dumps(cases), text=True,
                          capture_output=True, env=vllm_env(), timeout=150, check=True)
    want = json.loads(proc.stdout)
    for algo in ("sha256", "sha256_cbor"):
        p = HashProfile(algo, "0")
        for bs, toks in cases:
            assert list(p.event_hashes(toks, bs)) == want[f"{algo}/{bs}"], (algo, bs)
