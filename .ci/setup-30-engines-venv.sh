#!/usr/bin/env bash
# Create (idempotently) the venv holding real SGLang 0.5.23 and LMCache 0.5.6 next to vLLM CPU
# 0.32.0, for the engine tests of issue #12. Notes: docs/engines.md (what runs, and why).
#
# Usage: .ci/setup-30-engines-venv.sh          # venv at $KVPLANE_ENGINES_VENV
#                                              # (default /opt/kvplane-engines-venv)
# Tests find the interpreter through KVPLANE_ENGINES_PYTHON and skip when it is absent.
# KVPLANE_ENGINES_REAL_MOONCAKE=1 also puts the real Mooncake wheel in $VENV/mooncake-real
# (a --target dir, NOT on the venv's path: the side-by-side benchmark prepends it to PYTHONPATH
# for its real-Mooncake runs, exactly as the kvplane `mooncake` shim is prepended for the others).
#
# Recipe, and why:
#  - The venv is a copy of the vLLM venv (.ci/setup-10-vllm-venv.sh), which stays untouched.
#    SGLang's server on a CPU device imports vllm._custom_ops (rotary embedding) when its own CPU
#    engine (SGLANG_USE_CPU_ENGINE=1, needing a CPU sgl_kernel build that is not on PyPI) is off,
#    and LMCache's vLLM connector needs vLLM anyway. A copy costs ~20 s and no downloads.
#  - sglang and lmcache go in with --no-deps: their declared dependencies pull CUDA builds
#    (torch==2.14.1, flashinfer, cuda-python, cupy, nvidia-*). The pure-Python imports they really
#    need are pinned below, also --no-deps, so no package vLLM already has is replaced.
#  - torchvision 0.28.0 from PyPI is a CUDA build: its ops library does not load on torch+cpu and
#    its import then fails ("operator torchvision::nms does not exist"). SGLang imports it at
#    module level (multimodal configs), so kvplane_torchvision_cpu.py (a .pth hook) defines the two
#    op schemas torchvision registers fakes for; the ops themselves stay unavailable.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${KVPLANE_ENGINES_VENV:-/opt/kvplane-engines-venv}"
VLLM_VENV="${KVPLANE_VLLM_VENV:-/opt/kvplane-vllm-venv}"
PY="$VENV/bin/python"
STAMP="$VENV/.kvplane-engines-ready"
CHECK="import vllm, sglang.srt.mem_cache.storage.mooncake_store.mooncake_store, \
sglang.srt.managers.cache_controller, sglang.srt.entrypoints.http_server, \
lmcache.v1.cache_engine, lmcache.v1.storage_backend.connector.mooncakestore_connector, \
lmcache.integration.vllm.vllm_v1_adapter"
EXTRAS=(orjson==3.13.0 sortedcontainers==2.4.0 triton==3.9.0 aiofile==3.12.3 caio==0.12.10
        torchvision==0.28.0 gguf==0.19.0 soundfile==0.14.0
        ipython==9.18.1 ipython_pygments_lexers==1.1.1 asttokens==3.0.2 executing==2.3.0
        jedi==0.20.1 matplotlib-inline==0.2.2 parso==0.8.7 pexpect==4.9.0 prompt_toolkit==3.0.53
        ptyprocess==0.7.0 pure_eval==0.2.4 stack-data==0.6.3 traitlets==5.16.1 wcwidth==0.9.4)
MOONCAKE_WHEEL=mooncake-transfer-engine-non-cuda==0.3.13.post1

real_mooncake() {
    [[ "${KVPLANE_ENGINES_REAL_MOONCAKE:-0}" == 1 ]] || return 0
    [[ -x "$VENV/mooncake-real/mooncake/mooncake_master" ]] && return 0
    # every Mooncake binary links libibverbs.so.1, even for tcp (shared/peers/mooncake/README.md)
    if ! ldconfig -p | grep -q 'libibverbs.so.1 '; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null
    fi
    "$PY" -m pip install --quiet --no-deps --target "$VENV/mooncake-real" "$MOONCAKE_WHEEL"
    PYTHONPATH="$VENV/mooncake-real" "$PY" -c \
        "from mooncake.store import MooncakeDistributedStore; from mooncake.engine import TransferEngine"
}

if [[ -f "$STAMP" ]] && "$PY" -c "$CHECK" >/dev/null 2>&1; then
    real_mooncake
    echo "engines venv ready: $PY"
    exit 0
fi

bash .ci/setup-10-vllm-venv.sh
rm -rf "$VENV"
cp -a "$VLLM_VENV" "$VENV"
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# the copy's bin/pip and console scripts still point at the vLLM venv: only ever `$PY -m pip`
rm -f "$SITE/kvplane-src.pth" "$VENV/.kvplane-vllm-ready"
"$PY" -m pip install --quiet --no-deps sglang==0.5.23 lmcache==0.5.6 "${EXTRAS[@]}"
cp .ci/engines/kvplane_torchvision_cpu.py "$SITE/"
echo "import kvplane_torchvision_cpu; kvplane_torchvision_cpu.install()" > "$SITE/kvplane-torchvision-cpu.pth"
"$PY" -c "$CHECK"
"$PY" -c "import sglang, lmcache, vllm, torch; print('sglang', sglang.__version__, 'lmcache', \
lmcache.__version__ if hasattr(lmcache, '__version__') else '0.5.6', 'vllm', vllm.__version__, \
'torch', torch.__version__)" 2>/dev/null
real_mooncake
touch "$STAMP"
echo "engines venv ready: $PY"
