#!/usr/bin/env bash
# Session 8, call B, for one GPU (nvidia-h100-x1). ~3 min: what the
# half-depth (tile_k = 32, 64-byte swizzle) pipeline steps cost, and whether
# more stages recover it, on the reduce-scatter's chunk matmuls of
# qwen2-72b (K = 7392, which needs them) and llama3-70b (K = 7168, which can
# run either depth), against XLA's dot.
set -u
source "$(dirname "$0")/gpu_env.sh"
R="$OUT/r38"; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || echo "install FAILED"
t kernel
timeout 400 python3 benchmarks/kernel_bench.py --models=qwen2-72b,llama3-70b \
  --full_models=qwen2-72b,llama3-70b --ops=rs --mcs=1024,3072 --num_sms=132 \
  --tune=true --tune_set=depth --rounds=7 --iters=20 \
  --out_dir="$R" --tag=depth_h100 > "$R/kernel.log" 2>&1
echo "kernel rc=$?"; grep -E "^\|" "$R/kernel_bench_depth_h100.md" | cut -c1-200
t end
