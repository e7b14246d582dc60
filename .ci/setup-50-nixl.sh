#!/usr/bin/env bash
# NIXL for the nixl transport's tests (issue 30): the wheel only, without its declared torch/CUDA
# dependencies (several GB; the import needs numpy alone). Idempotent.
set -euo pipefail
python -c "import nixl_cu12" 2>/dev/null && exit 0
pip install -q --no-deps nixl-cu12==1.5.1
python -c "import nixl_cu12; from nixl_cu12._api import nixl_agent; print('nixl ready')"
