#!/usr/bin/env bash
# Session 2, call F on the 4-GPU machine (~2.5 min): schedule=None through
# the refreshed autotune cache (autotune_shapes.py --keep=latest
# --margin=0.03) against XLA, both ops, the benchmark shapes.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/ficco_results10; rm -rf "$R"; mkdir -p "$R"
t install; python3 -m pip install --no-build-isolation --no-deps . > /dev/null 2>&1 || echo "install FAILED"
t ag
timeout 80 python3 benchmarks/ag_bench.py --axis_sizes=4 --models=llama3-8b,llama3-70b,gpt3-175b \
  --tokens=8192,4096 --square=false \
  --cases=16384x8192x8192,4096x8192x8192,2048x8192x8192 --schedules=default --peers= \
  --rounds=5 --iters=20 --time_budget_s=70 --out_dir="$R" --tag=w4_default2 > "$R/ag.log" 2>&1
echo "ag rc=$?"
t rs
timeout 60 python3 benchmarks/rs_bench.py --axis_sizes=4 --models=llama3-8b,llama3-70b \
  --tokens=8192,4096 --square=false --cases=16384x8192x8192,4096x8192x8192 \
  --schedules=default --rounds=5 --iters=20 --time_budget_s=50 --out_dir="$R" \
  --tag=w4_default2 > "$R/rs.log" 2>&1
echo "rs rc=$?"
t end
tar -czf "$OUT/results10.tar.gz" -C "$R" .
cat "$R"/*.md | grep -E "^\|" | head -30
