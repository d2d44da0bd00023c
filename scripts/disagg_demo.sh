#!/usr/bin/env bash
# One-command local demo of prefill/decode disaggregation: a prefill instance (EP 1, bootstrap port 8998), a decode
# instance (EP 2) and the router on http://127.0.0.1:8000, on the default config's random model; the prompts' KV
# cache moves by Mooncake's Transfer Engine over loopback TCP. Sends one request through the router, then serves
# until Ctrl-C (which stops all three). Extra arguments go to both instances, e.g. `--model /path/to/ckpt`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
VENV_PROGRESS=1 setup_venv serve,disagg
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait' EXIT INT TERM
.venv/bin/python -m server --config configs/default.yaml --port 8100 --ep-size 1 \
    --disaggregation-mode prefill --disaggregation-bootstrap-port 8998 "$@" 2>prefill.log &
pids+=($!)
.venv/bin/python -m server --config configs/default.yaml --port 8200 --ep-size 2 \
    --disaggregation-mode decode "$@" 2>decode.log &
pids+=($!)
.venv/bin/python -m server.router --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000 &
pids+=($!)
until curl -sf http://127.0.0.1:8000/health >/dev/null; do
    for pid in "${pids[@]}"; do
        kill -0 "$pid" 2>/dev/null || { echo "a server exited during start-up: see prefill.log, decode.log" >&2; exit 1; }
    done
    sleep 1
done
echo "router up on http://127.0.0.1:8000 (logs: prefill.log, decode.log); a request through it:" >&2
curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
    -d '{"prompt": "Disaggregated serving", "max_tokens": 16, "temperature": 0}'
echo
wait
