#!/usr/bin/env bash
# Make this checkout's kvplane importable inside the engines venv built by
# .ci/setup-30-engines-venv.sh (idempotent; a no-op when that venv is absent, so engine tests skip).
#
# Same .pth scheme as .ci/setup-20-vllm-kvplane.sh: most of kvplane's import path (msgspec, pyzmq,
# numpy, fastapi, httpx, uvicorn, prometheus-client, typer, rich) is already in the venv (it is a
# copy of the vLLM venv), and pip would try to upgrade them; the few it lacks are installed alone. The `mooncake` shim is NOT put on the venv's
# path: a test prepends kvplane.integrations.mooncake_shim.PATH to PYTHONPATH when it wants
# SGLang's / LMCache's Mooncake backends to run on kvplane.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${KVPLANE_ENGINES_PYTHON:-${KVPLANE_ENGINES_VENV:-/opt/kvplane-engines-venv}/bin/python}"
if [[ ! -x "$PY" ]]; then
    echo "setup-40-engines-kvplane: no engines venv python at $PY; engine tests will skip"
    exit 0
fi
# kvplane dependencies the copied vLLM venv lacks (xxhash, for checksums; the venv may predate
# setup-20 installing them): install only what is missing, never upgrading vLLM's or the engines'
# pins (same step as .ci/setup-20-vllm-kvplane.sh)
"$PY" .ci/install_missing_deps.py setup-40-engines-kvplane
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$PWD/src" > "$SITE/kvplane-src.pth"
"$PY" -c "import kvplane.compat.mooncake, kvplane.store.client.client, kvplane.transfer, \
kvplane.integrations.mooncake_shim, kvplane.integrations.sglang, kvplane.integrations.lmcache, xxhash; print('kvplane importable in', '$PY')"
