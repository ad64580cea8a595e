#!/usr/bin/env bash
# Session 3, call B on the 4-GPU machine (~5 min): profiles (JAX profiler,
# summarized by profile_summary.py) of the reduce-scatter schedules against
# XLA's, one all-gather, and the tensor-parallel block's training step with
# and without ficco ops, to see where device time goes.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/ficco_results12; rm -rf "$R"; mkdir -p "$R"
which nsys ncu > "$R/tools.txt" 2>&1
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || echo "install FAILED"
t profile_ops
timeout 200 python3 benchmarks/profile_ops.py --calls=10 --out_dir="$R" --specs=\
rs:4096x8192x8192:xla,rs:4096x8192x8192:direct/c1/dma,rs:4096x8192x8192:ring/c1/dma,\
rs:16384x8192x8192:xla,rs:16384x8192x8192:direct/c1/dma,rs:512x4096x4096:direct/c1/dma,\
ag:4096x8192x8192:xla,ag:4096x8192x8192:ring/c1/dma > "$R/profile_ops.log" 2>&1
echo "profile_ops rc=$?"
t tp_block
timeout 200 python3 benchmarks/tp_block_bench.py --out_dir="$R" --d_model=4096 --heads=32 \
  --d_ff=14336 --seq=8192 --schedule=ring:1:dma --variant_timeout_s=95 --rounds=3 --iters=5 \
  --profile_steps=3 > "$R/tp_block.log" 2>&1
echo "tp_block rc=$?"; tail -4 "$R/tp_block.log"
t end
tar -czf "$OUT/results12.tar.gz" -C "$R" .
