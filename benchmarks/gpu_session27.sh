#!/usr/bin/env bash
# Session 5, call D on the 4-GPU machine (~4.5 min): the tensor-parallel
# block's training step with and without ficco ops on this session's protocol
# (tp = 4, seq 8192, schedule=None), at two widths, with peak memory.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/ficco_results27; rm -rf "$R"; mkdir -p "$R"
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || echo "install FAILED"
for w in "4096 32 14336" "8192 64 28672"; do
  set -- $w
  t "tp_block d=$1"
  timeout 120 python3 benchmarks/tp_block_bench.py --out_dir="$R" --d_model=$1 --heads=$2 \
    --d_ff=$3 --seq=8192 --schedule=default --variant_timeout_s=57 --rounds=5 --iters=5 \
    --tag=gpu_dp1tp4_d$1 > "$R/tp_block_d$1.log" 2>&1
  echo "tp rc=$?"; grep -E "^\| (ficco|xla)|speedup|resolves" "$R/tp_block_d$1.log"
done
t end
tar -czf "$OUT/results27.tar.gz" -C "$R" .
