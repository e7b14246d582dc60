"""Drive real vLLM engines from outside vLLM's venv (e2e tests and benchmarks).

vLLM runs in subprocesses under the vLLM venv's interpreter (``KVPLANE_VLLM_PYTHON``, default
``/opt/kvplane-vllm-venv/bin/python``) executing :mod:`kvplane.testing.vllm_engine_proc`; this
side only spawns and talks JSON lines, so it imports neither vLLM nor torch. kvplane reaches the
venv through PYTHONPATH (the directory holding this ``kvplane`` package).

Test kit, not product: nothing outside tests and benchmarks imports it.
"""

from __future__ import annotations

import json
import os
import pathlib
import selectors
import subprocess
import time
from typing import Any

VLLM_PYTHON = os.environ.get("KVPLANE_VLLM_PYTHON", "/opt/kvplane-vllm-venv/bin/python")
SRC = pathlib.Path(__file__).resolve().parents[2]  # the directory holding ``kvplane``
DRIVER = ["-m", "kvplane.testing.vllm_engine_proc"]
BS = 32


def vllm_env(extra_path: str = "", **extra: str) -> dict[str, str]:
    """Environment for a vLLM subprocess: offline, loopback, small KV space, kvplane on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    path = [p for p in (extra_path, str(SRC)) if p]
    env.update(PYTHONPATH=os.pathsep.join(path), PYTHONHASHSEED="0", HF_HUB_OFFLINE="1",
               VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1", OMP_NUM_THREADS="1",
               MOONCAKE_REQUESTER_LOCAL_HOSTNAME="127.0.0.1", TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


def make_model(model_dir: pathlib.Path, spec: dict[str, int] | None = None,
               timeout: float = 120) -> pathlib.Path:
    """A random-weight float32 Llama written by the vLLM venv (default: 2 layers, 2 heads x 64)."""
    if not (model_dir / "config.json").exists():
        subprocess.run([VLLM_PYTHON, *DRIVER, "make-model", str(model_dir), json.dumps(spec or {})],
                       check=True, env=vllm_env(), timeout=timeout, capture_output=True)
    return model_dir


def store_kv_config(master: str, **extra: Any) -> dict[str, Any]:
    """kv_transfer_config for KVPlaneStoreConnector against ``master``."""
    return {"kv_connector": "KVPlaneStoreConnector",
            "kv_connector_module_path": "kvplane.integrations.vllm", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"master_server_address": master, "protocol": "tcp",
                                          "metadata_server": "P2PHANDSHAKE", "timeout": 5,
                                          **extra}}


class Driver:
    """One offline vLLM engine in a subprocess, spoken to one JSON line at a time."""

    def __init__(self, log_path: pathlib.Path, cfg: dict[str, Any],
                 env: dict[str, str] | None = None, argv: list[str] | None = None) -> None:
        """``argv`` replaces the default driver program (any script that speaks the same
        READY / DONE line protocol); ``cfg`` is then unused."""
        self.log_path = log_path
        self.log = open(log_path, "w")
        args = argv if argv is not None else [*DRIVER, "serve", json.dumps(cfg)]
        self.proc = subprocess.Popen([VLLM_PYTHON, *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env or vllm_env())
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.proc.stdout, selectors.EVENT_READ)

    def expect(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if self.sel.select(left):
                line = self.proc.stdout.readline()
                if not line:
                    break
                if line.startswith(prefix):
                    return line[len(prefix):].strip()
        raise AssertionError(f"vLLM driver: no {prefix!r} within {timeout}s; log tail:\n"
                             f"{self.log_text()[-4000:]}")

    def log_text(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def send(self, **cmd: Any) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def call(self, timeout: float, **cmd: Any) -> Any:
        self.send(**cmd)
        return json.loads(self.expect("DONE ", timeout))

    def generate(self, tokens: list[int], max_tokens: int = 8, timeout: float = 60) -> dict[str, Any]:
        return self.call(timeout, op="generate", tokens=tokens, max_tokens=max_tokens)

    def ready(self, timeout: float = 300) -> "Driver":
        self.expect("READY", timeout)
        return self

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.send(op="exit")
                self.proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
            for f in (self.proc.stdin, self.proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
            self.sel.close()
            self.log.close()


def prompt(seed: int, n: int = 100) -> list[int]:
    """A deterministic token-id prompt (n=100: three full 32-token blocks plus 4 tokens)."""
    return [(i * 37 + seed * 101 + 11) % 997 + 1 for i in range(n)]


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))
