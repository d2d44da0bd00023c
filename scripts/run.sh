#!/usr/bin/env bash
# The main job: installs what it needs into .venv (CPU torch 2.13.0) and runs it on this machine's CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[serve]'
exec .venv/bin/python examples/ll_demo.py "$@"
