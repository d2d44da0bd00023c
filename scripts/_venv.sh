# Sourced by scripts/run.sh and scripts/test.sh (not run on its own): `setup_venv EXTRAS` creates .venv in the
# current directory if it is missing ($PYTHON, default python3) and installs CPU torch 2.13.0, then this package
# in editable mode with the extras EXTRAS (e.g. `serve` or `serve,dev`).
setup_venv() {
    [ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
    .venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[$1]"
}
