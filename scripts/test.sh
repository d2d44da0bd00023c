#!/usr/bin/env bash
# Installs what the tests need into .venv (CPU torch 2.13.0, no accelerator) and runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[serve,dev]'
exec .venv/bin/python -m pytest -q "$@"
