#!/usr/bin/env bash
# The GPU check, offline: for a machine that already has a CUDA build of torch (2.5 or later)
# and no network, as a cluster node usually is. Nothing is installed: the package runs from
# src/ (PYTHONPATH), its C++ kernel is built on first use with the local compiler, and it needs
# only what such a machine has beside torch (numpy, pyyaml, safetensors, tokenizers, tqdm;
# pytest for the tests, matplotlib for nothing here).
#
# 1. the GPU tests: every kernel that runs on CUDA against the dense reference in fp32 and bf16,
#    forward and backward, FlexAttention's block masks and graph budget, cached == full decoding;
# 2. benchmarks/gpu_check.py: training tokens/s, MFU and peak memory of ecp, sliding_window and
#    the transformer at the paper width (T = 2k, 8k, 32k; 64k for the local patterns; bf16),
#    each local pattern's attention call timed with FlexAttention and with its own kernels (the
#    fastest recorded beside auto's choice), FlexAttention block-mask memory and compile counts,
#    compiled batch-1 decoding against the bandwidth floor, one layer of each recurrent mixer
#    timed in bf16 with its chunked form and with flash-linear-attention's kernels where that is
#    installed (pip install fla-core; the GPU tests compare fla with the reference there too),
#    the faster beside auto's choice, and one training step of each mixer eager and compiled.
# Under 8 minutes in all. Results go to $OUT (default benchmarks/results): gpu_tests.txt and
# gpu_check.json; the table is printed.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
PY=${PY:-python3}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: $PY has no CUDA torch (set PY to a python that has one)" >&2
    exit 2
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
"$PY" -c "import torch; print('device:', torch.cuda.get_device_name(0), 'torch', torch.__version__)"
status=0
if "$PY" -c "import pytest" 2>/dev/null; then
    timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/model/test_gpu.py \
        tests/model/test_flex.py 2>&1 | tee "$OUT/gpu_tests.txt" || status=1
else
    echo "gpu_check: no pytest here; the GPU tests were not run" | tee "$OUT/gpu_tests.txt"
    status=1
fi
timeout 260 "$PY" benchmarks/gpu_check.py --budget 200 --json "$OUT/gpu_check.json" || status=1
exit $status
