#!/usr/bin/env bash
# For a machine with a CUDA GPU: the GPU correctness tests, ECP's attention kernels on the GPU
# (FlexAttention against segment-batched SDPA, bf16, forward + backward), then `ecp bench` on the
# GPU (bf16), decoding in its three modes and the training step in its four, in under
# 10 minutes. Results go to $OUT (default benchmarks/results): gpu_tests.txt,
# attention_gpu.json, bench_gpu.json, bench_gpu.png, decode_gpu.json, train_modes_gpu.json.
# Uses the torch already installed if it sees a GPU, otherwise creates .venv and installs the
# default (CUDA) torch build.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
PY=${PY:-python3}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    "$PY" -m venv .venv-gpu
    PY=.venv-gpu/bin/python
    "$PY" -m pip install --quiet torch
fi
"$PY" -m pip install --quiet -e '.[dev]'
"$PY" -c "import torch; print('device:', torch.cuda.get_device_name(0), 'torch', torch.__version__)"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
timeout 240 "$PY" -m pytest -q tests/test_gpu.py tests/test_kernels.py tests/test_generate.py \
    tests/test_decode.py -x 2>&1 | tee "$OUT/gpu_tests.txt"
timeout 90 "$PY" benchmarks/attention.py --device cuda --dtype bfloat16 --heads 16 \
    --seq-lens 4096,16384,65536 --json "$OUT/attention_gpu.json"
timeout 300 "$PY" -m ecp_lm bench --device cuda \
    --archs ecp,transformer,perceiver_ar,double,sliding_window,block_local,s2 \
    --seq-lens 2048,4096,8192,16384 --d-model 512 --n-heads 8 --batch-size 4 --repeats 5 \
    --decode --json "$OUT/bench_gpu.json" --plot "$OUT/bench_gpu.png"
timeout 120 "$PY" -m ecp_lm bench --device cuda --decode-only --d-model 512 --n-heads 8 \
    --decode-lengths 2048,16384 --decode-window 4096 --json "$OUT/decode_gpu.json"
timeout 150 "$PY" -m ecp_lm bench --device cuda --train-modes --archs ecp,transformer \
    --seq-lens 4096 --d-model 512 --n-heads 8 --batch-size 4 --repeats 5 \
    --json "$OUT/train_modes_gpu.json"
