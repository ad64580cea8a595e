#!/usr/bin/env bash
# Session 4, call F on the 4-GPU machine (~3 min): the tensor-parallel
# block's training step with schedule=None once the heuristic runs the
# reduce-scatter's copy-engine pieces on the Pallas kernel
# (DeviceParams.pallas_pieces; the block's 3-D operands are not in the
# autotune cache, so the heuristic decides for them).
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/ficco_results23; rm -rf "$R"; mkdir -p "$R"
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
tar -czf "$OUT/results23.tar.gz" -C "$R" .
