#!/usr/bin/env bash
# Session 8, call A, for one GPU (nvidia-h100-x1). ~3 min. Ran on commit
# d05c77f (reverted: Mosaic GPU tiles the GMEM operand as well, so K must
# be a multiple of the 64-deep step; results/h100_session8_a):
#  1. the Pallas kernel tests on the GPU, among them the last K step
#     zero-filled by TMA (K = 104 and qwen2-72b's 7392, not multiples of the
#     64-deep step), which the Mosaic GPU interpreter cannot check;
#  2. the reduce-scatter's chunk matmuls of qwen2-72b (K = 7392, now at full
#     depth) and llama3-70b (K = 7168, for comparison) against XLA's dot.
set -u
source "$(dirname "$0")/gpu_env.sh"
R="$OUT/r37"; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || echo "install FAILED"
t pytest
timeout 200 python3 -P -m pytest -q -rs -p no:cacheprovider tests/test_pallas_chunk_matmul.py \
  > "$R/pytest_pallas_gpu.txt" 2>&1
echo "pytest rc=$?"; tail -3 "$R/pytest_pallas_gpu.txt"
t kernel
timeout 200 python3 benchmarks/kernel_bench.py --models=qwen2-72b,llama3-70b --full_models= \
  --ops=rs --mcs=1024,3072,4096 --num_sms=132 --tune=false --rounds=7 --iters=20 \
  --out_dir="$R" --tag=ktail_h100 > "$R/kernel.log" 2>&1
echo "kernel rc=$?"; grep -E "^\|" "$R/kernel_bench_ktail_h100.md" | cut -c1-220
t end
