"""Drive real vLLM engines from outside vLLM's venv (e2e tests and benchmarks).

vLLM runs in subprocesses under the vLLM venv's interpreter (``KVPLANE_VLLM_PYTHON``, default
``/opt/kvplane-vllm-venv/bin/python``) executing :mod:`tests.support.vllm_engine_proc`; this
side only spawns and talks JSON lines, so it imports neither vLLM nor torch. kvplane reaches the
venv through PYTHONPATH (the directory holding this ``kvplane`` package).

Test kit, not product: nothing outside tests and benchmarks imports it.
"""

from __future__ import annotations

import json
import os
import pathlib
import selectors
import signal
import subprocess
import time
from typing import Any

import kvplane

VLLM_PYTHON = os.environ.get("KVPLANE_VLLM_PYTHON", "/opt/kvplane-vllm-venv/bin/python")
SRC = pathlib.Path(kvplane.__file__).resolve().parents[1]  # the directory holding ``kvplane``
ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repo root: ``tests.support`` for drivers
DRIVER = ["-m", "tests.support.vllm_engine_proc"]
BS = 32


def vllm_env(extra_path: str = "", **extra: str) -> dict[str, str]:
    """Environment for a vLLM subprocess: offline, loopback, small KV space, kvplane on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    path = [p for p in (extra_path, str(SRC), str(ROOT)) if p]
    env.update(PYTHONPATH=os.pathsep.join(path), PYTHONHASHSEED="0", HF_HUB_OFFLINE="1",
               VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1", OMP_NUM_THREADS="1",
               MOONCAKE_REQUESTER_LOCAL_HOSTNAME="127.0.0.1", TOKENIZERS_PARALLELISM="false")
    # vLLM CPU's default ("auto") pins every server's worker to the same cores when several
    # run on one host, so their spinning main threads starve each other's (and the kvplane
    # connectors') threads: a PD pull's handshake then timed out after 5 s (docs/vllm.md)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
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


def offload_kv_config(master: str, **extra: Any) -> dict[str, Any]:
    """kv_transfer_config for vLLM's OffloadingConnector with kvplane's spec against ``master``."""
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "KVPlaneOffloadingSpec",
                                          "spec_module_path": "kvplane.integrations.vllm.offload",
                                          "master_server_address": master, "protocol": "tcp",
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

    def ready(self, timeout: float = 300) -> Driver:
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


class OpenAIServer:
    """A vLLM OpenAI ``api_server`` subprocess on 127.0.0.1 (tests and benchmarks).

    Prefix caching on (sha256, PYTHONHASHSEED=0), eager mode, float32. With ``events`` it
    publishes KV events on that endpoint (``ipc://`` or ``tcp://*:`` binds; a router connects)
    and serves replay on ``replay``. ``VLLM_SERVER_DEV_MODE=1`` enables ``/reset_prefix_cache``.

    Args:
        model: model directory.
        log_path: where its output goes.
        events: KV event PUB endpoint, or None for no events.
        replay: replay ROUTER endpoint, or None.
        max_model_len: context length.
        max_num_seqs: most sequences in one batch.
        block_size: KV block size.
        extra: more command-line arguments.
        env: environment overrides (e.g. ``MOONCAKE_CONFIG_PATH``); None removes a variable
            (``VLLM_CPU_KVCACHE_SPACE: None``, so that ``--kv-cache-memory-bytes`` applies).
        extra_path: a directory put first on the server's PYTHONPATH (e.g. real Mooncake).
    """

    def __init__(self, model: str, log_path: pathlib.Path, events: str | None = None,
                 replay: str | None = None, max_model_len: int = 512, max_num_seqs: int = 2,
                 block_size: int = BS, extra: list[str] | None = None,
                 env: dict[str, str | None] | None = None, extra_path: str = "") -> None:
        from tests.support.services import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        args = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", "float32", "--max-model-len", str(max_model_len),
                "--max-num-seqs", str(max_num_seqs), "--block-size", str(block_size),
                "--enforce-eager", "--enable-prefix-caching", "--prefix-caching-hash-algo", "sha256",
                *(extra or [])]
        if events is not None:
            cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events,
                   "replay_endpoint": replay, "topic": "kv"}
            args += ["--kv-events-config", json.dumps(cfg)]
        penv = vllm_env(extra_path, VLLM_SERVER_DEV_MODE="1")
        for k, v in (env or {}).items():
            if v is None:
                penv.pop(k, None)
            else:
                penv[k] = v
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=penv,
                                     start_new_session=True)  # its engine core joins the group

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def ready(self) -> bool:
        """True once ``/health`` answers 200 (raises if the process died)."""
        import httpx

        if self.proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited:\n{self.log_path.read_text()[-3000:]}")
        try:
            return httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def metric(self, name: str) -> float:
        """The sum of one metric's samples in ``/metrics`` (e.g. ``vllm:prefix_cache_hits_total``)."""
        import httpx

        text = httpx.get(self.url + "/metrics", timeout=10, trust_env=False).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))

    def reset_prefix_cache(self) -> None:
        """Empty its prefix cache (vLLM publishes AllBlocksCleared)."""
        import httpx

        r = httpx.post(self.url + "/reset_prefix_cache", timeout=30, trust_env=False)
        r.raise_for_status()

    def kill(self, reap: bool = True) -> None:
        """kill -9 the instance (API server and engine core, one process group); reap unless told."""
        self._signal_group(signal.SIGKILL)
        if reap:
            self.proc.wait(30)

    def close(self) -> None:
        """Terminate the instance (kill -9 after 30 s) and close the log."""
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        self._signal_group(signal.SIGKILL)  # whatever of the group is left
        self.proc.wait(30)
        self.log.close()
