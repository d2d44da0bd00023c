#!/usr/bin/env bash
# Installs what the tests need into .venv (CPU torch 2.13.0, no accelerator; Mooncake's Transfer Engine and the
# libibverbs1 / librdmacm1 it loads) and the engines tests/engines runs (tests/engines/install.py), lints,
# type-checks, builds the docs, runs the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
setup_venv serve,dev,disagg
# Every check runs even if an earlier one fails; any failure fails the script (settings: pyproject.toml).
status=0
.venv/bin/ruff check . || status=1
.venv/bin/ruff format --check . || status=1
.venv/bin/mypy deep_ep_npu server || status=1
# The docs site: a broken link or anchor fails the build (mkdocs.yml: strict).
site=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$site" || status=1
rm -rf "$site"
# The engines' released packages tests/engines runs (pinned, in a cache folder outside .venv; seconds once cached).
.venv/bin/python -m tests.engines.install || status=1
# pytest last, so that its summary is the closing line (CI reads it); its exit status wins if it fails.
.venv/bin/python -m pytest -q "$@" || status=$?
exit "$status"
