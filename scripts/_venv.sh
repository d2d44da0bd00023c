# Sourced by scripts/run.sh and scripts/test.sh (not run on its own): `setup_venv EXTRAS` creates .venv in the
# current directory if it is missing ($PYTHON, default python3) and installs CPU torch 2.13.0, then this package
# in editable mode with the extras EXTRAS (e.g. `serve` or `serve,dev`).
# VENV_PROGRESS=1 shows pip's own output (what it downloads and installs, with progress bars) instead of -q.
setup_venv() {
    local quiet=(-q)
    [ "${VENV_PROGRESS:-0}" = 1 ] && quiet=()
    [ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
    echo "setup: torch 2.13.0 (CPU) and deep_ep_npu[$1] into .venv (the first time: about a minute)" >&2
    .venv/bin/python -m pip install "${quiet[@]}" --disable-pip-version-check torch==2.13.0
    .venv/bin/python -m pip install "${quiet[@]}" --disable-pip-version-check -e ".[$1]"
}
