#!/usr/bin/env bash
# Installs what the tests need into .venv (CPU torch 2.13.0, no accelerator; Mooncake's Transfer Engine and the
# libibverbs1 / librdmacm1 it loads), lints and type-checks, runs the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
setup_venv serve,dev,disagg
# Every check runs even if an earlier one fails; any failure fails the script (settings: pyproject.toml).
status=0
.venv/bin/ruff check . || status=1
.venv/bin/ruff format --check . || status=1
.venv/bin/mypy deep_ep_npu server || status=1
# pytest last, so that its summary is the closing line (CI reads it); its exit status wins if it fails.
.venv/bin/python -m pytest -q "$@" || status=$?
exit "$status"
