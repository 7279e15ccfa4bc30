#!/usr/bin/env bash
# make test-gpu: the labs on a node with >= 2 CUDA GPUs, on NCCL. Elsewhere it
# prints one line saying why it skipped and exits 0.
#
#   1. the tests marked `gpu` (launcher on NCCL, the memory test on CUDA)
#   2. the graders, %%ranks and the torchrun path (ls.main), auto backend
#   3. every chapter through papermill and nbval on NCCL, the sanitizer for
#      GPU-only outputs (tests/nbval_sanitize_gpu.cfg) added to the usual one
#
# LABSUPPORT_BACKEND=auto picks NCCL wherever a group has a GPU per rank (the
# suite's own default is gloo); LABSUPPORT_P2P is empty: NCCL itself, not
# gloo's imitation of it (labsupport.launch.strict_p2p).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
gpus=$($PY -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$gpus" -lt 2 ]; then
    echo "test-gpu: skipped: $gpus CUDA GPU(s) visible; the NCCL path needs at least 2"
    exit 0
fi
export LABSUPPORT_BACKEND=auto LABSUPPORT_P2P=
sanitize=$(mktemp --suffix=.cfg)
trap 'rm -f "$sanitize"' EXIT
cat tests/nbval_sanitize.cfg tests/nbval_sanitize_gpu.cfg > "$sanitize"
export LABSUPPORT_NBVAL_SANITIZE="$sanitize"
echo "test-gpu: $gpus GPUs visible: NCCL"
$PY -m pytest -m gpu tests/
$PY -m pytest -m "not slow" tests/test_grading.py tests/test_grading_*.py \
    tests/test_launcher_kernel.py tests/test_torchrun.py tests/test_doctor.py
$PY -m pytest tests/test_notebooks.py
