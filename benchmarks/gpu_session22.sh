#!/usr/bin/env bash
# Session 4, call E on the 4-GPU machine (~6 min): schedule=None after the
# cache refill from calls A and D (Pallas pieces for the reduce-scatter where
# they won), both ops against XLA on the benchmark shapes (interleaved), and
# the tensor-parallel block's training step with schedule=None at two widths.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/ficco_results22; rm -rf "$R"; mkdir -p "$R"
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || echo "install FAILED"
for op in rs ag; do
  t "$op default"
  PEERS=""; [ "$op" = ag ] && PEERS="--peers="
  timeout 125 python3 benchmarks/${op}_bench.py --axis_sizes=4 \
    --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
    --schedules=default $PEERS --interleave --rounds=7 --iters=20 --time_budget_s=110 \
    --out_dir="$R" --tag=w4_final > "$R/${op}_final.log" 2>&1; echo "$op rc=$?"
done
for w in "4096 32 14336" "8192 64 28672"; do
  set -- $w
  t "tp_block d=$1"
  timeout 120 python3 benchmarks/tp_block_bench.py --out_dir="$R" --d_model=$1 --heads=$2 \
    --d_ff=$3 --seq=8192 --schedule=default --variant_timeout_s=57 --rounds=5 --iters=5 \
    --tag=gpu_dp1tp4_d$1 > "$R/tp_block_d$1.log" 2>&1
  echo "tp rc=$?"; grep -E "^\| (ficco|xla)|speedup|resolves" "$R/tp_block_d$1.log"
done
t end
tar -czf "$OUT/results22.tar.gz" -C "$R" .
for f in "$R"/rs_w4_final.md "$R"/ag_w4_final.md; do echo "== $f"; grep -E "^\|" "$f" | cut -c1-230; done
