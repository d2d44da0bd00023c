#!/usr/bin/env bash
# The main job: installs what it needs into .venv (CPU torch 2.13.0) and serves the default config on this machine:
# an OpenAI-compatible API on http://127.0.0.1:8000 over 2 expert-parallel decode workers (gloo, a small random
# Qwen3-MoE-style model; nothing is downloaded). Extra arguments override the config, e.g. `--port 9000`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
VENV_PROGRESS=1 setup_venv serve
exec .venv/bin/python -m server --config configs/default.yaml "$@"
