#!/usr/bin/env bash
# Make this checkout's kvplane importable inside the vLLM venv built by .ci/setup-10-vllm-venv.sh
# (idempotent; a no-op when that venv is absent, so the vLLM e2e tests skip).
#
# A .pth file points the venv at <repo>/src, like an editable install without touching the
# venv's packages: kvplane's import path (msgspec, pyzmq, numpy, fastapi, httpx, uvicorn,
# prometheus-client, typer, rich) is already in the venv as vLLM dependencies, and pip would try
# to upgrade them; the few it lacks are installed alone. The check below fails loudly if that ever stops being true.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${KVPLANE_VLLM_PYTHON:-${KVPLANE_VLLM_VENV:-/opt/kvplane-vllm-venv}/bin/python}"
if [[ ! -x "$PY" ]]; then
    echo "setup-20-vllm-kvplane: no vLLM venv python at $PY; vLLM e2e tests will skip"
    exit 0
fi
# kvplane dependencies vLLM does not bring (xxhash, for checksums): install only what is missing,
# never upgrading what vLLM pinned
"$PY" .ci/install_missing_deps.py setup-20-vllm-kvplane
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$PWD/src" > "$SITE/kvplane-src.pth"
"$PY" -c "import kvplane.integrations.vllm.store_connector, kvplane.integrations.vllm.pd_connector, \
kvplane.store.client.client, kvplane.transfer; print('kvplane importable in', '$PY')"
