#!/usr/bin/env bash
# Create or refresh the project's virtual environment (.venv) from requirements.txt.
# Idempotent: a stamp holding the hash of the inputs makes a second run a no-op.
# Usage: scripts/setup_env.sh        (called by `make lab`, `make book` and `make test`)
# TORCH_INDEX=<url>: take torch from that index (make lab sets PyTorch's CPU index,
# https://download.pytorch.org/whl/cpu, so a laptop gets the CPU build, not the CUDA
# one PyPI serves on Linux); pip.conf's find-links (a local wheel cache) still count.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
PYTHON=${PYTHON:-python3}
STAMP=$VENV/.requirements.sha256
want=$(cat requirements.txt pyproject.toml | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
    exit 0
fi

"$PYTHON" - <<'PY'
import sys
if sys.version_info < (3, 11):
    sys.exit(f"Python >= 3.11 is needed (found {sys.version.split()[0]}); set PYTHON=python3.11")
PY

echo "setup: creating/refreshing $VENV from requirements.txt"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip_install() {
    # Some machines list partial local mirrors in pip.conf; their misses are noise,
    # so they are filtered from stderr (pip's own exit status still counts).
    "$VENV/bin/python" -m pip install -q "$@" 2> >(grep -v "is ignored: it is neither" >&2)
}
if [ -n "${TORCH_INDEX:-}" ]; then
    # torch alone, from that index instead of PyPI, as PyTorch's install selector
    # says; its dependencies come from PyPI with the rest (-r below), which finds
    # the installed 2.13.0+cpu satisfies torch==2.13.0.
    torch_pin=$(grep -E '^torch==' requirements.txt | cut -d' ' -f1)
    echo "setup: $torch_pin from $TORCH_INDEX"
    pip_install --no-deps "$torch_pin" --index-url "$TORCH_INDEX"
fi
pip_install -r requirements.txt
"$VENV/bin/python" -m pip check
pip_install --no-deps --no-build-isolation -e .
"$VENV/bin/python" -c "import torch, labsupport, plotly, nbval, papermill, nbgrader" \
    || { echo "setup: the environment is incomplete (see errors above)"; exit 1; }
# A kernel spec inside the venv, so notebooks run with this interpreter.
"$VENV/bin/python" -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (course)" >/dev/null
echo "$want" > "$STAMP"
echo "setup: $VENV ready ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
