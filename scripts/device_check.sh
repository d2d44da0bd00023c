#!/usr/bin/env bash
# The accelerator tests only (`-m "gpu or npu"`; they skip elsewhere), on a machine with a CUDA GPU.
# Installs like scripts/test.sh but keeps the torch already in .venv (or in $DEVICE_PYTHON's env): it must see CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${DEVICE_PYTHON:-.venv/bin/python}
[ -n "${DEVICE_PYTHON:-}" ] || [ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
if ! "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    echo "device_check: no torch with CUDA in $PY; install a CUDA build of torch there, or set DEVICE_PYTHON" >&2
    exit 1
fi
"$PY" -m pip install -q --disable-pip-version-check -e '.[serve,dev]'  # torch is already satisfied: not reinstalled
exec "$PY" -m pytest -m "gpu or npu" -q "$@"
