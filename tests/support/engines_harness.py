"""Drive SGLang and LMCache from outside their venv (e2e tests and benchmarks/engines.py).

The engines run in subprocesses under the engines venv's interpreter (``KVPLANE_ENGINES_PYTHON``,
default ``$KVPLANE_ENGINES_VENV/bin/python``, venv default ``/opt/kvplane-engines-venv``, built by
``.ci/setup-30-engines-venv.sh``) executing :mod:`tests.support.sglang_proc` or
:mod:`tests.support.lmcache_proc`; this side only spawns them and speaks JSON lines, so it
imports neither engine nor torch. Which ``mooncake`` package a driver imports is chosen here and
nowhere else: kvplane's shim, real Mooncake (``<venv>/mooncake-real``), or none.

Test kit, not product.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
from typing import Any, Literal

import kvplane
from kvplane.common.errors import Timeout
from kvplane.common.procs import wait_for_line
from kvplane.testing.needs import requires

ENGINES_VENV = os.environ.get("KVPLANE_ENGINES_VENV", "/opt/kvplane-engines-venv")
ENGINES_PYTHON = os.environ.get("KVPLANE_ENGINES_PYTHON", f"{ENGINES_VENV}/bin/python")
REAL_MOONCAKE = pathlib.Path(ENGINES_VENV) / "mooncake-real"
SRC = pathlib.Path(kvplane.__file__).resolve().parents[1]  # the directory holding ``kvplane``
ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repo root: ``tests.support`` for drivers
# kvplane.integrations.mooncake_shim.PATH, named by path: kvplane modules never import integrations
SHIM_PATH = SRC / "kvplane" / "integrations" / "mooncake_shim"
Mooncake = Literal["kvplane", "real", "none"]
HOW = "bash .ci/setup-30-engines-venv.sh && bash .ci/setup-40-engines-kvplane.sh"


def need_engines() -> None:
    """Skip (fail in CI) unless the engines venv exists."""
    if not os.access(ENGINES_PYTHON, os.X_OK):
        requires("engines")


def real_mooncake_reason() -> str | None:
    """Why real Mooncake cannot run here (None when it can)."""
    pkg = REAL_MOONCAKE / "mooncake"
    if not (pkg / "mooncake_master").exists():
        return (f"real Mooncake is not installed at {REAL_MOONCAKE} "
                "(KVPLANE_ENGINES_REAL_MOONCAKE=1 bash .ci/setup-30-engines-venv.sh)")
    return None


def engines_env(mooncake: Mooncake = "kvplane", **extra: str) -> dict[str, str]:
    """Environment of an engine driver: offline, loopback, fixed hash seed, one ``mooncake``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    first = {"kvplane": str(SHIM_PATH), "real": str(REAL_MOONCAKE), "none": ""}[mooncake]
    env.update(PYTHONPATH=os.pathsep.join(p for p in (first, str(SRC), str(ROOT)) if p),
               PYTHONHASHSEED="0", HF_HUB_OFFLINE="1", LMCACHE_TRACK_USAGE="false",
               SGLANG_HOST_IP="127.0.0.1", MOONCAKE_LOCAL_HOSTNAME="127.0.0.1",
               MC_TCP_BIND_ADDRESS="127.0.0.1", GLOG_minloglevel="1", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # as vllm_harness.vllm_env says
    env.update(extra)
    return env


class EngineError(AssertionError):
    """An engine driver answered with an error or died."""


class EngineDriver:
    """One engine driver process (``engine``: ``sglang`` or ``lmcache``).

    Args:
        engine: which driver module to run.
        log_path: the driver's stderr (engine logs) goes here.
        mooncake: which ``mooncake`` package the driver may import.
        ready_timeout: seconds for imports and setup; None: return at once and call
            :meth:`ready` later (start several drivers, then wait for all: imports dominate).
    """

    def __init__(self, engine: str, log_path: pathlib.Path, mooncake: Mooncake = "kvplane",
                 env: dict[str, str] | None = None, ready_timeout: float | None = 180.0) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [ENGINES_PYTHON, "-m", f"tests.support.{engine}_proc"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1,
            env={**engines_env(mooncake), **(env or {})})
        self.info: dict[str, Any] = {}
        if ready_timeout is not None:
            self.ready(ready_timeout)

    def ready(self, timeout: float = 180.0) -> EngineDriver:
        """Wait for the ready line (the driver is closed if it does not come)."""
        try:
            self.info = self.read(timeout)
        except EngineError:
            self.close()
            raise
        return self

    def read(self, timeout: float) -> dict[str, Any]:
        """The next protocol line.

        Raises:
            EngineError: nothing within ``timeout``, or the driver exited (with its log tail).
        """
        assert self.proc.stdout is not None
        try:
            return json.loads(wait_for_line(self.proc.stdout, timeout))  # type: ignore[no-any-return]
        except (Timeout, EOFError, ValueError) as exc:
            raise EngineError(f"engine driver: {exc}; log tail:\n{self.log_tail()}") from exc

    def send(self, op: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout: float) -> dict[str, Any]:
        """Read past ``stage`` lines to the op's reply; an ``error`` reply raises EngineError."""
        while True:
            msg = self.read(timeout)
            if "stage" in msg:
                continue
            if "error" in msg:
                raise EngineError(f"{msg['error']}\n{msg.get('traceback', '')}")
            return msg

    def call(self, op: str, timeout: float = 120.0, **args: Any) -> dict[str, Any]:
        """Send ``op`` and wait for its reply."""
        self.send(op, **args)
        return self.reply(timeout)

    def log_tail(self, n: int = 6000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def close(self, timeout: float = 30.0) -> None:
        """Ask the driver to exit, kill it if it lingers (idempotent)."""
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
            for f in (self.proc.stdin, self.proc.stdout):
                try:
                    if f:
                        f.close()
                except OSError:
                    pass
            self._log.close()

    def __enter__(self) -> EngineDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
