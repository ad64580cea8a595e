#!/usr/bin/env bash
# Session 7, call C, for the 4-GPU machine (nvidia-h200-x4). ~8 min:
#  1. issue 6's ten shapes, schedule=None through the cache refilled from
#     calls A and B (--keep=worst), with the schedules it picks, a third run;
#  2. the tensor-parallel block's training step, ficco vs XLA, and peak
#     memory (d 4096 and 8192, tp = 4, seq 8192).
# At most 8 files come back: the logs hold what the tables say.
set -u
source "$(dirname "$0")/gpu_env.sh"
R="$OUT/r36"; rm -rf "$R"; mkdir -p "$R"  # straight into $OUT: a cut call still returns its files
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || echo "install FAILED"
t rs
timeout 260 python3 benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default,none,direct/c1/dma,direct/c1/dma/pallas,direct/c2/dma/pallas/step,ring/c1/dma \
  --interleave --rounds=9 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=240 --out_dir="$R" --tag=w4_issue6_c > "$R/rs.log" 2>&1
echo "rs rc=$?"; grep -E "^\|" "$R/rs_w4_issue6_c.md" | cut -c1-250
for w in "4096 32 14336" "8192 64 28672"; do
  set -- $w
  t "tp_block d=$1"
  timeout 120 python3 benchmarks/tp_block_bench.py --out_dir="$R" --d_model=$1 --heads=$2 \
    --d_ff=$3 --seq=8192 --schedule=default --variant_timeout_s=57 --rounds=5 --iters=5 \
    --tag=gpu_dp1tp4_d$1 > "$R/tp_block_d$1.log" 2>&1
  echo "tp rc=$?"; grep -E "^\| (ficco|xla)|speedup|resolves" "$R/tp_block_d$1.log"
done
ls "$R"
t end
