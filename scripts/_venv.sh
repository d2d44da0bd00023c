# Sourced by scripts/run.sh and scripts/test.sh (not run on its own): `setup_venv EXTRAS` creates .venv in the
# current directory if it is missing ($PYTHON, default python3) and installs CPU torch 2.13.0, then this package
# in editable mode with the extras EXTRAS (e.g. `serve` or `serve,dev`).
# VENV_PROGRESS=1 shows pip's own output (what it downloads and installs, with progress bars) instead of -q.
# Extras with `disagg` (Mooncake's Transfer Engine) also get the RDMA user-space libraries its module loads
# (Debian's libibverbs1 and librdmacm1), from apt-get when they are missing.
install_rdma_libs() {
    ldconfig -p 2>/dev/null | grep -q "libibverbs.so.1 " && ldconfig -p 2>/dev/null | grep -q "librdmacm.so.1 " && return 0
    local sudo=()
    [ "$(id -u)" = 0 ] || sudo=(sudo)
    echo "setup: libibverbs1 and librdmacm1 (apt-get; Mooncake's Transfer Engine loads them)" >&2
    if ! "${sudo[@]}" apt-get install -y -q libibverbs1 librdmacm1 >/dev/null 2>&1; then
        "${sudo[@]}" apt-get update -q >/dev/null && "${sudo[@]}" apt-get install -y -q libibverbs1 librdmacm1 >/dev/null
    fi
}
setup_venv() {
    case ",$1," in *,disagg,*) install_rdma_libs ;; esac
    local quiet=(-q)
    [ "${VENV_PROGRESS:-0}" = 1 ] && quiet=()
    [ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
    echo "setup: torch 2.13.0 (CPU) and deep_ep_npu[$1] into .venv (the first time: about a minute)" >&2
    .venv/bin/python -m pip install "${quiet[@]}" --disable-pip-version-check torch==2.13.0
    .venv/bin/python -m pip install "${quiet[@]}" --disable-pip-version-check -e ".[$1]"
}
